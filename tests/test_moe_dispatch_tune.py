"""The moe-dispatch tuner (`hubtools.bench.moe_dispatch_tune`) on the CPU: how it turns timings into table entries."""

from hubtools.bench.moe_dispatch_tune import best_configs, decode_config, stream_config


def test_tuner_takes_a_faster_stream_config():
    """The tuner's table entry at T = 1: the decode kernels' fastest pair, unless a stream config ran faster than
    that pair (the down search's best row, which ran with the best gate / up)."""
    def rows(stream_seconds):
        return ([{"model": "qwen3-30b-a3b", "T": 1, "kernel": "gate_up", "candidate": [64, 128, 4, 4], "seconds": 9.0},
                 {"model": "qwen3-30b-a3b", "T": 1, "kernel": "gate_up", "candidate": [32, 128, 4, 6], "seconds": 8.0},
                 {"model": "qwen3-30b-a3b", "T": 1, "kernel": "down", "candidate": [16, 256, 4, 4], "seconds": 7.0},
                 {"model": "qwen3-30b-a3b", "T": 1, "kernel": "down", "candidate": [64, 128, 4, 4], "seconds": 7.5}]
                + [{"model": "qwen3-30b-a3b", "T": 1, "kernel": "stream", "candidate": "s2-16x256", "seconds": s}
                   for s in stream_seconds])
    decode = decode_config([32, 128, 4, 6], [16, 256, 4, 4])
    assert best_configs(rows([]))["qwen3-30b-a3b"][1] == decode
    assert best_configs(rows([7.2]))["qwen3-30b-a3b"][1] == decode
    assert best_configs(rows([6.5]))["qwen3-30b-a3b"][1] == stream_config("s2-16x256")
