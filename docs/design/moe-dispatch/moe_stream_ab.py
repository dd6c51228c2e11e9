"""E58b A/B: `experts` at T = 1 with bf16 experts, the decode kernels against the tuner's `"STREAM"` configs,
interleaved graph replays in one process over rotated layer copies; each stream variant's output is first checked
against the shipped one (sums in another order: relative error <= 1e-2). (Runs 153 / 155 also timed E58c, int4
down plans of a packed stream GEMV, from this script on branch `exp/e58b-stream-t1`; E58c was not merged.)

    python docs/design/moe-dispatch/moe_stream_ab.py BUILD_DIR OUT.json [model ...]
"""
import json
import sys
from pathlib import Path

import kernels
import torch

from hubtools.bench.moe_dispatch import MODELS
from hubtools.bench.moe_dispatch_tune import STREAM, Problem, stream_config
from hubtools.measure import rotation_count, time_graphs_interleaved, warm_clocks


def checked_times(name, calls, copies):
    """{variant: [seconds per round]} of `calls` ({variant: fn(i)}), each checked against the first."""
    ref = next(iter(calls.values()))(0).float()
    for v, fn in calls.items():
        got = fn(0).float()
        err = ((got - ref).norm() / ref.norm()).item()
        assert err <= 1e-2, f"{name} {v}: relative error {err:.2e} against the shipped kernels"
    return dict(zip(calls, time_graphs_interleaved(list(calls.values()), copies, rounds=7)))


build, out_path, *names = sys.argv[1:]
k = kernels.get_local_kernel(Path(build))
tk = k.ops.triton_kernels
dev = torch.device("cuda")
warm_clocks()
rows = []
for name in names or ["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"]:
    m = MODELS[name]
    copies = rotation_count(m.top_k * m.expert_bytes(), max_copies=8)
    problem = Problem(tk, m, 1, copies)
    shipped = tk.get_config(1, m.experts, m.hidden, m.intermediate, m.top_k, torch.bfloat16, dev)
    configs = {"shipped": shipped}
    configs.update({v: stream_config(v) for v in STREAM})
    times = checked_times(f"{name} bf16", {v: problem.call(c) for v, c in configs.items()}, copies)
    bound = m.top_k * m.expert_bytes()
    print(f"{name} bf16 T=1 ({bound / 1e6:.1f} MB): " + ", ".join(f"{v} {min(t) * 1e6:.1f}" for v, t in times.items())
          + " us", flush=True)
    rows.append(dict(model=name, experts="bf16", weight_bytes=bound, configs=configs, seconds=times))
    del problem
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(out_path, "w"), indent=1)
