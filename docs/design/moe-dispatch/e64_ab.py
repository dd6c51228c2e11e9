"""E64 / E65 A/B: 4-bit experts (int4 g128, bf16 x) at T = 1 and 4 with the packed GEMVs' plan keys PDL_TRIGGER,
EARLY_PREFETCH ("lines", and "words" where the down GEMV is one loop step) and FOLD_COMBINE, against the shipped
plan. `experts` alone as the tuner times it (rotated layer
copies, the benchmark's routed inputs): every variant's output first checked bit-equal to the shipped plan's, then
interleaved CUDA-graph replays (`time_graphs_interleaved`). Then each kernel's own time for the shipped plan and
the full variant (torch.profiler over eager calls), which says where the layer's time goes.

    python docs/design/moe-dispatch/e64_ab.py BUILD_DIR OUT.json [model ...]     (env ROUNDS, default 7)
"""
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import kernels
import torch

from hubtools.bench.moe_dispatch import MODELS
from hubtools.bench.moe_dispatch_tune import _quant_cases
from hubtools.measure import environment, time_graphs_interleaved, warm_clocks

VARIANTS = {  # name: (gate_up keys, down keys)
    "shipped": ({}, {}),
    "start": ({"PDL_TRIGGER": "start"}, {}),
    "early": ({}, {"EARLY_PREFETCH": "lines"}),
    "start-early": ({"PDL_TRIGGER": "start"}, {"EARLY_PREFETCH": "lines"}),
    "words": ({}, {"EARLY_PREFETCH": "words"}),
    "start-words": ({"PDL_TRIGGER": "start"}, {"EARLY_PREFETCH": "words"}),
    "fold": ({}, {"FOLD_COMBINE": True}),
    "start-early-fold": ({"PDL_TRIGGER": "start"}, {"EARLY_PREFETCH": "lines", "FOLD_COMBINE": True}),
    "start-words-fold": ({"PDL_TRIGGER": "start"}, {"EARLY_PREFETCH": "words", "FOLD_COMBINE": True}),
}
PROFILED = ("shipped", "words", "start-words-fold", "start-early-fold")


def kernel_times(fn, copies, calls=50):
    """{kernel name: mean us} of `fn(i)` called eagerly (i cycling over the layer copies), by torch.profiler."""
    for i in range(5):
        fn(i % copies)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i % copies)
        torch.cuda.synchronize()
    total = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time
    return {name: t / calls for name, t in total.items()}


build, out_path, *names = sys.argv[1:]
rounds = int(os.environ.get("ROUNDS", 7))
k = kernels.get_local_kernel(Path(build))
tk = k.ops.triton_kernels
warm_clocks()
rows = []
for name, T, copies, call, ref, bound in _quant_cases(tk, k, names or ["qwen3-30b-a3b"], [1, 4]):
    m = MODELS[name]
    shipped = tk.default_config(T, m.experts, m.hidden, m.intermediate, m.top_k, torch.device("cuda"),
                                quantized=True, packed=True)
    # "words" needs a down GEMV of one loop step (Qwen3's K = 768 in 8-tile steps; not Mixtral's or DeepSeek's)
    one_step = -(-m.intermediate // 128) <= shipped["down"]["TILES"]
    configs = {v: {**shipped, "gate_up": {**shipped["gate_up"], **up}, "down": {**shipped["down"], **down}}
               for v, (up, down) in VARIANTS.items() if one_step or down.get("EARLY_PREFETCH") != "words"}
    expected = call(configs["shipped"])(0).clone()
    for v, config in configs.items():
        assert torch.equal(call(config)(0), expected), f"{name} T={T} {v}: not bit-equal to the shipped plan"
    times = dict(zip(configs, time_graphs_interleaved([call(c) for c in configs.values()], copies, rounds=rounds)))
    best = {v: min(t) for v, t in times.items()}
    print(f"{name} T={T} (bound {bound * 1e6:.1f} us): " + ", ".join(
        f"{v} {best[v] * 1e6:.2f} ({best['shipped'] / best[v]:.3f}x)" for v in configs), flush=True)
    profile = {v: kernel_times(call(configs[v]), copies) for v in PROFILED if v in configs}
    for v, kt in profile.items():
        print(f"  {v} eager kernels: " + ", ".join(f"{n[:40]} {t:.2f}" for n, t in sorted(kt.items())), flush=True)
    rows.append(dict(model=name, T=T, bound_seconds=bound, configs=configs, seconds=times, kernel_us=profile))
json.dump(dict(env=environment(["python"] + sys.argv), rows=rows), open(out_path, "w"), indent=1)
