"""E63 / E64 A/B: `experts` (4-bit int4 g128, bf16 x) under combinations of gate/up and down plan keys, interleaved rounds,
as the tuner times them (graph replay, rotated layer copies). python docs/design/moe-dispatch/e64_ab.py BUILD OUT.json MODEL... """
import json, sys, statistics
import kernels, torch
from hubtools.bench.moe_dispatch import graph_seconds
from hubtools.bench.moe_dispatch_tune import _quant_cases
from hubtools.measure import warm_clocks
k = kernels.get_local_kernel(sys.argv[1]); tk = k.ops.triton_kernels
plan = {"BLOCK_N": 16, "BLOCK_K": 128, "TILES": 8, "num_warps": 2, "num_stages": 3, "X_BCAST": True, "TMA": True, "PDL": True}
VARIANTS = {
    "shipped": ({}, {}),
    "trigger-start": ({"PDL_TRIGGER": "start"}, {}),
    "early-bulk": ({}, {"EARLY_PREFETCH": "bulk"}),
    "early-lines": ({}, {"EARLY_PREFETCH": "lines"}),
    "trigger-start+early-bulk": ({"PDL_TRIGGER": "start"}, {"EARLY_PREFETCH": "bulk"}),
    "trigger-start+early-lines": ({"PDL_TRIGGER": "start"}, {"EARLY_PREFETCH": "lines"}),
    "pf-lines-before": ({"PREFETCH_DOWN": "lines-before"}, {}),
    "pf-lines-after": ({"PREFETCH_DOWN": "lines-after"}, {}),
}
warm_clocks()
rows = []
for name, T, copies, call, ref, bound in _quant_cases(tk, k, sys.argv[3:], [1]):
    times = {v: [] for v in VARIANTS}
    for v, (up, down) in VARIANTS.items():
        cfg = {"GEMV": True, "gate_up": {**plan, **up}, "down": {**plan, **down}}
        err = ((call(cfg)(0).float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (name, v, err)
    for r in range(5):
        order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
        for v in order:
            up, down = VARIANTS[v]
            times[v].append(graph_seconds(call({"GEMV": True, "gate_up": {**plan, **up}, "down": {**plan, **down}}), copies))
    base = statistics.median(times["shipped"])
    for v, t in times.items():
        med = statistics.median(t)
        rows.append({"model": name, "T": T, "variant": v, "median_s": med, "all_s": t, "bound_s": bound})
        print(f"{name} T={T} {v}: {med * 1e6:.2f} us (x{base / med:.3f} of shipped; rounds {min(t) * 1e6:.2f}-{max(t) * 1e6:.2f})", flush=True)
    json.dump({"rows": rows, "gpu": torch.cuda.get_device_name()}, open(sys.argv[2], "w"), indent=1)
