"""The w4a16 benchmark's own tools, on the CPU."""

import json
import math
from pathlib import Path

import pytest
import torch

from hubtools.bench.w4a16 import (GOAL_HEURISTIC_VS_TUNED, _matmul_with, bench_as_compare, goals, main,
                                  merge_compare, stand_in_table, wgmma_split_regret)
from hubtools.workspace import Workspace


def test_a_table_stands_in_for_another_cards_only_in_the_build(load_kernel):
    """`--configs`: the H200 table read as another card's, then no table for it again (the heuristic); the files
    change in the kernel's build, never in the project's own configs folder."""
    k = load_kernel("w4a16")
    source = Workspace.load().kernel("w4a16").root / "torch-ext" / "w4a16" / "configs"
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    assert Path(k.tuning.CONFIG_DIR).resolve() != source.resolve()
    try:
        assert k.tuning.table("Some GPU") == {}
        stand_in_table(k, "Some GPU", source / "nvidia-h200.json")
        assert k.tuning.table("Some GPU") == json.loads((source / "nvidia-h200.json").read_text())
    finally:
        stand_in_table(k, "Some GPU", None)
    assert k.tuning.table("Some GPU") == {}
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before


def test_heuristic_rows_run_the_given_config(load_kernel, monkeypatch):
    """The bench's `ours-heuristic` rows: `_matmul_with` launches the weight with the config it is given (here
    through the interpreter), the bits `triton_kernels.matmul` gives for that config, and the product the op gives."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = load_kernel("w4a16")
    g = torch.Generator().manual_seed(3)
    qw = k.quantize(torch.randn(256, 384, generator=g) * 0.02, group_size=128, zero_point=True)
    x = torch.randn(3, 384, generator=g).half()
    config = k.tuning.heuristic(3, 256, 384, 4)
    out = _matmul_with(k, x, qw, config)
    assert torch.equal(out, k.triton_kernels.matmul(x, qw.qweight, qw.scales, qw.zeros, None, None, 256, 384, 128,
                                                    config))
    torch.testing.assert_close(out, k.matmul(x, qw), rtol=2e-3, atol=2e-3)


def test_goals_compare_the_heuristic_with_the_table():
    """One goal per M: the geometric mean over the Llama-3 shapes of tuned time / heuristic time (shapes outside
    the issue's set are reported, not scored)."""
    rows = []
    for label, tuned, heuristic in (("L3-8B qkv", 1.0, 1.25), ("L3-70B o", 2.0, 2.0), ("Q2.5-1.5B qkv", 1.0, 9.0)):
        for impl, seconds in (("ours", tuned), ("ours-heuristic", heuristic), ("cublas-fp16", 4.0)):
            rows.append({"case": f"{label} M=64 fp16", "impl": impl, "seconds": seconds, "bytes": 1})
    found = [g for g in goals({"rows": rows, "copy_bandwidth": 1.0}) if g["goal"].startswith("heuristic")]
    assert len(found) == 1 and found[0]["case"] == "M=64 fp16, 2 shapes"
    assert math.isclose(found[0]["value"], math.sqrt(0.8)) and found[0]["target"] == GOAL_HEURISTIC_VS_TUNED
    assert not found[0]["met"]


def test_merge_compare_takes_symmetric_results_and_bf16_overrides():
    """The tables are tuned on symmetric int4 g128 with fp16 x: a `--compare-decode` result measured with zero
    points is refused; a symmetric one puts a candidate that beats the shipped config by more than the margin in
    the table; one with bf16 x puts the keys in which its winner differs into the entry's "bf16" override, and
    only where an fp16 entry exists; a later fp16 winner keeps that override."""
    env = {"date": "d", "torch": "t", "triton": "tr", "cuda": "c", "command": "cmd"}
    rows = [{"shape": "L3-8B qkv", "m": 1, "impl": "shipped", "us": 10.0, "config": {"kernel": "gemv"}},
            {"shape": "L3-8B qkv", "m": 1, "impl": "candidate", "us": 8.0, "config": {"kernel": "dot"}}]
    with pytest.raises(ValueError, match="zero points True"):
        merge_compare({}, {"env": env, "fmt": "int4", "group": 128, "zero_point": True, "rows": rows})
    bf16 = {"env": env, "fmt": "int4", "group": 128, "x_dtype": "bfloat16", "rows": rows}
    table = {}
    assert "not written" in merge_compare(table, bf16)[0] and table["shapes"]["6144x4096"] == {}
    changes = merge_compare(table, {"env": env, "fmt": "int4", "group": 128, "zero_point": False, "rows": rows})
    assert len(changes) == 1 and table["shapes"]["6144x4096"]["1"] == {"kernel": "dot"}
    shipped = {"kernel": "gemv", "block_n": 8, "bf16": {"kernel": "dot"}}
    bf16["rows"] = [dict(rows[0], config=shipped), dict(rows[1], config={"kernel": "gemv", "block_n": 8,
                                                                         "mma": {"tiles": 4}, "bf16": {}})]
    table["shapes"]["6144x4096"]["1"] = {"kernel": "gemv", "block_n": 8}
    assert len(merge_compare(table, bf16)) == 1
    assert table["shapes"]["6144x4096"]["1"] == {"kernel": "gemv", "block_n": 8, "bf16": {"mma": {"tiles": 4}}}
    assert len(merge_compare(table, {"env": env, "fmt": "int4", "group": 128, "rows": rows})) == 1
    assert table["shapes"]["6144x4096"]["1"] == {"kernel": "dot", "bf16": {"mma": {"tiles": 4}}}


def test_merge_compare_keeps_larger_m_on_what_it_ran():
    """A winner at a table's largest bucket would also run every larger M: an M measured above all of a changed
    entry's buckets keeps the config it ran, as a bucket of its own; an unchanged entry gets none."""
    env = {"date": "d", "torch": "t", "triton": "tr", "cuda": "c", "command": "cmd"}
    dequant = {"kernel": "dequant", "chunk_n": 0}
    rows = []
    for shape, m, shipped_us, candidate_us in (("L3-8B qkv", 1024, 10.0, 8.0), ("L3-8B qkv", 4096, 40.0, 44.0),
                                              ("L3-8B o", 1024, 10.0, 9.9), ("L3-8B o", 4096, 40.0, 44.0)):
        rows += [{"shape": shape, "m": m, "impl": "shipped", "us": shipped_us, "config": dequant},
                 {"shape": shape, "m": m, "impl": "candidate", "us": candidate_us,
                  "config": {**dequant, "wgmma": {"block_m": 128}}}]
    table = {"shapes": {"6144x4096": {"1024": dequant}, "4096x4096": {"1024": dequant}}}
    changes = merge_compare(table, {"env": env, "fmt": "int4", "group": 128, "rows": rows})
    assert len(changes) == 2
    assert table["shapes"]["6144x4096"] == {"1024": {**dequant, "wgmma": {"block_m": 128}}, "4096": dequant}
    assert table["shapes"]["4096x4096"] == {"1024": dequant}


def test_merge_compare_puts_nf4_winners_into_nf4_keys():
    """An NF4 result writes the winning wgmma tile into the bucket's "nf4" keys and leaves the int4 config as it
    is; a winner without wgmma removes the override; a winner that differs from the shipped NF4 launch in other
    keys is not written."""
    env = {"date": "d", "torch": "t", "triton": "tr", "cuda": "c", "command": "cmd"}
    dot = {"kernel": "dot", "block_m": 64}
    tile = {"block_m": 128, "block_n": 256, "split_k": 2}
    rows = []
    for shape, m, candidate in (("L3-8B qkv", 256, {**dot, "wgmma": tile}), ("L3-8B o", 256, dot),
                                ("L3-70B o", 256, {**dot, "block_m": 128, "wgmma": tile})):
        shipped = {**dot, "wgmma": tile} if shape == "L3-8B o" else dot
        rows += [{"shape": shape, "m": m, "impl": "shipped", "us": 10.0, "config": shipped},
                 {"shape": shape, "m": m, "impl": "candidate", "us": 8.0, "config": candidate}]
    int4 = {"kernel": "dot", "block_m": 64, "wgmma": {"block_m": 128}}
    table = {"shapes": {"6144x4096": {"256": dict(int4)}, "4096x4096": {"256": {**int4, "nf4": {"wgmma": tile}}},
                        "8192x8192": {"256": dict(int4)}}}
    changes = merge_compare(table, {"env": env, "fmt": "nf4", "group": 64, "rows": rows})
    assert len(changes) == 3
    assert [c for c in changes if "not written" in c] == [c for c in changes if c.startswith("L3-70B o")]
    assert table["shapes"]["6144x4096"]["256"] == {**int4, "nf4": {"wgmma": tile}}
    assert table["shapes"]["4096x4096"]["256"] == int4
    assert table["shapes"]["8192x8192"]["256"] == int4
    with pytest.raises(ValueError, match="NF4 with fp16 x"):
        merge_compare(table, {"env": env, "fmt": "nf4", "group": 64, "x_dtype": "bfloat16", "rows": rows})


def test_merge_compare_puts_nf4_decode_plans_into_nf4_keys():
    """An NF4 winner at M = 1 that differs from the shipped launch only in its packed-GEMV plan writes that whole
    plan into the "nf4" keys, beside an override already there; so does one that differs only in taking the pair
    table ("nf4_smem"); one that drops the shipped launch's mma plan is not written."""
    env = {"date": "d", "torch": "t", "triton": "tr", "cuda": "c", "command": "cmd"}
    half2 = {"block_n": 8, "tiles": 32, "num_warps": 4}
    gemv = {"kernel": "gemv", "block_n": 8, "tiles": 8, "half2": half2}
    faster = {**half2, "persistent": 4}
    mma = {"num_warps": 4, "tiles": 4}
    rows = [{"shape": "L3-8B gate_up", "m": 1, "impl": "shipped", "us": 40.0, "config": gemv},
            {"shape": "L3-8B gate_up", "m": 1, "impl": "candidate", "us": 37.0, "config": {**gemv, "half2": faster}},
            {"shape": "L3-8B down", "m": 4, "impl": "shipped", "us": 20.0, "config": {**gemv, "mma": mma}},
            {"shape": "L3-8B down", "m": 4, "impl": "candidate", "us": 15.0, "config": gemv}]
    tile = {"block_m": 128, "block_n": 256}
    table = {"shapes": {"28672x4096": {"1": {**gemv, "nf4": {"wgmma": tile}}},
                        "4096x14336": {"4": {**gemv, "mma": mma}}}}
    dot = {"kernel": "dot", "block_m": 64, "block_n": 128}
    rows += [{"shape": "L3-70B o", "m": 64, "impl": "shipped", "us": 30.0, "config": dot},
             {"shape": "L3-70B o", "m": 64, "impl": "candidate", "us": 27.0, "config": {**dot, "nf4_smem": True}}]
    table["shapes"]["8192x8192"] = {"64": dict(dot)}
    changes = merge_compare(table, {"env": env, "fmt": "nf4", "group": 64, "rows": rows})
    assert table["shapes"]["8192x8192"]["64"] == {**dot, "nf4": {"nf4_smem": True}}  # E73e's per-shape choice
    assert table["shapes"]["28672x4096"]["1"] == {**gemv, "nf4": {"half2": faster}}
    assert table["shapes"]["4096x14336"]["4"] == {**gemv, "mma": mma}
    assert [c for c in changes if "not written" in c] == [c for c in changes if c.startswith("L3-8B down")]


def test_merge_result_merges_a_saved_compare_into_the_table_file(tmp_path, capsys):
    """`--merge-result`: a result file written by an earlier --compare-decode run goes into --table's file as
    `merge_compare` puts it (with that run's own provenance), nothing timed; without --table it is refused."""
    env = {"date": "d", "torch": "t", "triton": "tr", "cuda": "c", "command": "the compare's command"}
    tile = {"block_m": 128, "block_n": 256}
    dot = {"kernel": "dot", "block_m": 64}
    rows = [{"shape": "L3-8B qkv", "m": 256, "impl": "shipped", "us": 10.0, "config": dot},
            {"shape": "L3-8B qkv", "m": 256, "impl": "candidate", "us": 8.0, "config": {**dot, "wgmma": tile}}]
    result, table = tmp_path / "result.json", tmp_path / "table.json"
    result.write_text(json.dumps({"env": env, "fmt": "nf4", "group": 64, "rows": rows}))
    table.write_text(json.dumps({"shapes": {"6144x4096": {"256": dot}}}))
    assert main(["--merge-result", str(result), "--table", str(table)]) == 0
    merged = json.loads(table.read_text())
    assert merged["shapes"]["6144x4096"]["256"] == {**dot, "nf4": {"wgmma": tile}}
    assert merged["measured"][-1]["command"] == "the compare's command"
    with pytest.raises(SystemExit):
        main(["--merge-result", str(result)])
    assert "needs --table" in capsys.readouterr().err


def test_wgmma_split_regret_scores_the_pick_against_the_fastest_split():
    """For each shape, M and tile timed at several splits: the picked split's time over the fastest's; tiles timed
    at one split, "auto" rows and picks that were not timed are left out."""
    tile = {"block_m": 128, "block_n": 256}
    rows = [{"shape": "a", "N": 8192, "K": 28672, "m": 640, "us": us, "config": {"wgmma": {**tile, "split_k": s}}}
            for s, us in ((1, 600.0), (2, 500.0), (4, 450.0))]
    rows += [{"shape": "b", "N": 4096, "K": 4096, "m": 256, "us": 10.0, "config": {"wgmma": {**tile, "split_k": 2}}},
             {"shape": "b", "N": 4096, "K": 4096, "m": 256, "us": 9.0, "config": {"wgmma": {**tile, "split_k": "auto"}}},
             {"shape": "c", "N": 4096, "K": 4096, "m": 64, "us": 5.0, "config": {"wgmma": {**tile, "split_k": 1}}},
             {"shape": "c", "N": 4096, "K": 4096, "m": 64, "us": 4.0, "config": {"wgmma": {**tile, "split_k": 2}}}]
    seen = []

    def choose(m, n, k, block_m, block_n, sm_count):
        seen.append((m, n, k, block_m, block_n, sm_count))
        return 2 if m == 640 else 4

    scored = wgmma_split_regret(choose, [{"rows": rows}], 132)
    assert [(r["shape"], r["picked"], r["regret"]) for r in scored] == [("a", 2, 500.0 / 450.0)]
    assert (640, 8192, 28672, 128, 256, 132) in seen


def test_interleaved_timing_replays_each_graph_once_a_round_from_a_moving_start(monkeypatch):
    """`time_graphs_interleaved`: every launch once a round, the round's first launch one further along each
    round (so drift over the run falls on all alike), and each time divided by the captured calls, ``[fn][round]``."""
    from hubtools import measure

    order = []
    monkeypatch.setattr(measure, "_captured", lambda fn, n_inputs, calls: fn)
    monkeypatch.setattr(measure, "_replay_seconds", lambda graph: order.append(graph) or 10.0 * (graph + 1))
    times = measure.time_graphs_interleaved([0, 1, 2], 4, calls=5, rounds=4)
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]
    assert times == [[2.0] * 4, [4.0] * 4, [6.0] * 4]


def test_clock_samples_parse_nvidia_smi_lines_and_drop_unread_ones():
    """`parse_clock_samples` (what `ClockLog` records): time stamps to ``time.time()`` seconds with their
    fraction, the clock, power and limit reasons as read; a line with ``[N/A]`` or of other fields is left out;
    `between` keeps the samples inside a span."""
    import time

    from hubtools import measure

    text = ("2026/12/06 18:08:07.120, 1455, 690.53, 0x0000000000000004\n"
            "2026/12/06 18:08:07.140, [N/A], 690.00, 0x0000000000000004\n"
            "garbage line\n"
            "2026/12/06 18:08:08.000, 1980, 116.2, 0x0000000000000000\n")
    samples = measure.parse_clock_samples(text)
    base = time.mktime(time.strptime("2026/12/06 18:08:07", "%Y/%m/%d %H:%M:%S"))
    assert [(round(s["t"] - base, 3), s["sm_mhz"], s["power_w"], s["reasons"]) for s in samples] == [
        (0.12, 1455, 690.53, "0x0000000000000004"), (1.0, 1980, 116.2, "0x0000000000000000")]
    log = measure.ClockLog()
    log.samples = samples
    assert [s["sm_mhz"] for s in log.between(base + 0.5, base + 2)] == [1980]


def test_sustained_replays_time_each_replay_until_the_time_is_up(monkeypatch):
    """`sustained_replays`: the graph is replayed back to back until `seconds` have passed, each replay's time
    divided by the captured calls and stamped with the seconds since the start."""
    from hubtools import measure

    now = iter(range(100))
    monkeypatch.setattr(measure.time, "time", lambda: float(next(now)))
    monkeypatch.setattr(measure, "_captured", lambda fn, n_inputs, calls: "graph")
    monkeypatch.setattr(measure, "_replay_seconds", lambda graph: 8.0)
    replays = measure.sustained_replays(lambda i: None, 3, 4.5, calls=4)
    assert replays == [(2.0, 2.0), (4.0, 2.0)]  # the clock read once to test, once to stamp each replay


def test_merge_compare_keeps_the_nf4_and_bf16_overrides_of_a_replaced_entry():
    """An int4 winner replaces a bucket's config but not its "nf4" / "bf16" overrides (what NF4 and bf16 x run was
    measured on its own); an M above every bucket keeps what it ran, NF4 keys included."""
    env = {"date": "d", "torch": "t", "triton": "tr", "cuda": "c", "command": "cmd"}
    dot, tile = {"kernel": "dot", "block_m": 64}, {"block_m": 128, "block_n": 256}
    rows = [{"shape": "L3-8B qkv", "m": 256, "impl": "shipped", "us": 10.0, "config": dot},
            {"shape": "L3-8B qkv", "m": 256, "impl": "candidate", "us": 8.0, "config": {**dot, "wgmma": tile}},
            {"shape": "L3-8B qkv", "m": 1024, "impl": "shipped", "us": 40.0, "config": dot}]
    table = {"shapes": {"6144x4096": {"256": {**dot, "nf4": {"wgmma": tile}, "bf16": {"num_warps": 8}}}}}
    assert len(merge_compare(table, {"env": env, "fmt": "int4", "group": 128, "rows": rows})) == 2
    assert table["shapes"]["6144x4096"] == {
        "256": {**dot, "wgmma": tile, "nf4": {"wgmma": tile}, "bf16": {"num_warps": 8}},
        "1024": {**dot, "nf4": {"wgmma": tile}}}


def test_a_results_bench_merges_its_heuristic_rows_where_they_won(load_kernel):
    """`bench_as_compare`: a results bench's fp16 "ours" rows become the shipped launches (their config: the
    row's own, or in older files what the table holds) and its "ours-heuristic" rows the candidates; other
    formats, bf16 rows, untuned shapes and M outside `tokens` are left out. Merged, the heuristic's launch goes in
    only where it won by more than the margin."""
    tuned_config = load_kernel("w4a16").tuning.tuned_config
    dot, heuristic = {"kernel": "dot", "block_m": 64}, {"kernel": "dot", "block_m": 128, "wgmma": {"block_m": 128}}
    rows = []
    for label, m, ours, theirs in (("L3-8B qkv", 256, 10.0, 7.0), ("L3-8B o", 256, 10.0, 9.9),
                                   ("L3-8B qkv", 16, 10.0, 5.0), ("Q2.5-1.5B qkv", 256, 10.0, 5.0)):
        rows += [{"case": f"{label} M={m} fp16", "impl": "ours", "seconds": ours * 1e-6},
                 {"case": f"{label} M={m} fp16", "impl": "ours-heuristic", "seconds": theirs * 1e-6,
                  "config": heuristic},
                 {"case": f"{label} M={m} fp16", "impl": "ours-nf4", "seconds": 1e-6},
                 {"case": f"{label} M={m} bf16", "impl": "ours", "seconds": 1e-6}]
    results = {"kernel": "w4a16", "env": {"date": "d", "torch": "t", "triton": "tr", "cuda": "c", "command": "cmd"},
               "rows": rows}
    table = {"shapes": {"6144x4096": {"64": {"kernel": "gemv"}, "1024": dot}, "4096x4096": {"1024": dot}}}
    compared = bench_as_compare(results, table, tuned_config, tokens=[256])
    assert [(r["shape"], r["m"], r["impl"], r["config"]) for r in compared["rows"]] == [
        ("L3-8B qkv", 256, "shipped", dot), ("L3-8B qkv", 256, "candidate", heuristic),
        ("L3-8B o", 256, "shipped", dot), ("L3-8B o", 256, "candidate", heuristic)]
    assert len(merge_compare(table, compared)) == 1
    assert table["shapes"]["6144x4096"]["256"] == heuristic and table["shapes"]["4096x4096"] == {"1024": dot}
    with pytest.raises(ValueError, match="results bench"):
        bench_as_compare({"kernel": "rmsnorm", "rows": []}, table, tuned_config)


def test_the_results_bench_rows_on_the_cpu(load_kernel, monkeypatch):
    """`run` end to end through the interpreter on one small shape, its timers stubbed: per M the table's launch,
    the heuristic's and cuBLAS are verified against float64, timed interleaved, and each row gets its own best
    round (the stub gives each launch other times) with the table's config on "ours"; the other formats follow."""
    import hubtools.bench.w4a16 as bench

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = load_kernel("w4a16")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "rotation_count", lambda nbytes: 2)
    for name, value in (("warm_clocks", None), ("measure_copy_bandwidth", 1e12), ("measure_matmul_flops", 1e15)):
        monkeypatch.setattr(bench, name, lambda *args, value=value, **kwargs: value)
    interleaved = []

    def rounds(fns, n_inputs, calls=None, rounds=5):
        interleaved.append(len(fns))
        return [[3e-6 + j, 2e-6 + j, 4e-6 + j][:rounds] for j in range(len(fns))]

    monkeypatch.setattr(bench, "time_graphs_interleaved", rounds)
    monkeypatch.setattr(bench, "time_graph", lambda fn, n_inputs, **kwargs: 7e-6)
    results = bench.run(k, shapes=(("tiny", 256, 128),), tokens=(1, 3), bf16_shapes=())
    cases = {(row["case"], row["impl"]): row for row in results["rows"]}
    assert interleaved == [3, 3]
    for m in (1, 3):
        case = f"tiny M={m} fp16"
        timed = [cases[case, impl]["seconds"] for impl in ("ours", "ours-heuristic", "cublas-fp16")]
        assert timed == [2e-6, 1 + 2e-6, 2 + 2e-6]  # each launch's best round, in the order timed
        assert cases[case, "ours"]["config"] == k.tuning.select(m, 128, 256, torch.device("cpu"))
        assert all(cases[case, impl]["rel_err"] < 1e-2 for impl in ("ours", "ours-heuristic", "cublas-fp16"))
        assert cases[case, "ours-nf4"]["seconds"] == 7e-6 and cases[case, "ours-g32-min"]["seconds"] == 7e-6
