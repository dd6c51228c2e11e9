"""bf16 experts at T = 1 taken apart (the issue-16 goal on Qwen3-30B-A3B's small experts): each kernel's time
(torch.profiler over eager calls of `experts` with the shipped config) and `experts` under decode configs that
launch more programs than the table's (BLOCK_N 64: 96 gate/up programs for Qwen3 on 132 SMs), CUDA-graph
replay over rotated layer copies.

    python docs/design/moe-dispatch/moe_bf16_t1_probe.py BUILD_DIR OUT.json [model ...]
"""
import json
import sys
from collections import defaultdict
from pathlib import Path

import kernels
import torch

from hubtools.bench.moe_dispatch import MODELS, graph_seconds
from hubtools.bench.moe_dispatch_tune import COPIES, Problem, decode_config
from hubtools.measure import measure_copy_bandwidth, warm_clocks

# (BLOCK_N, BLOCK_K, num_warps, num_stages); the first is the H200 table's Qwen3 T = 1 entry for both kernels
CANDIDATES = [(64, 128, 4, 4), (64, 128, 4, 2), (32, 128, 4, 3), (32, 128, 2, 3), (16, 128, 4, 4), (16, 128, 2, 3),
              (16, 256, 2, 2), (32, 64, 2, 4)]

build, out_path, *names = sys.argv[1:]
tk = kernels.get_local_kernel(Path(build)).ops.triton_kernels
names = names or ["qwen3-30b-a3b", "mixtral-8x7b"]
warm_clocks()
bw = measure_copy_bandwidth()
rows = []
for name in names:
    m = MODELS[name]
    problem = Problem(tk, m, 1, COPIES)
    bound = m.top_k * m.expert_bytes() / bw
    shipped = tk.get_config(1, m.experts, m.hidden, m.intermediate, m.top_k, torch.bfloat16, torch.device("cuda"))
    fn = problem.call(None)
    for i in range(3):
        fn(i % COPIES)
    torch.cuda.synchronize()
    kernels = defaultdict(float)
    calls = 20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i % COPIES)
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += e.device_time_total / calls
    print(f"{name} T=1 bound {bound * 1e6:.1f} us; shipped {shipped}", flush=True)
    for k_name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"  {us:7.1f} us  {k_name[:90]}", flush=True)
    timed = []
    for kernel in ("gate_up", "down"):
        for c in CANDIDATES:
            trial = {**shipped, kernel: decode_config(c, c)[kernel]}
            try:
                t = graph_seconds(problem.call(trial), COPIES)
            except Exception as exc:  # a candidate that does not compile (shared memory) is reported, not fatal
                print(f"  {kernel} {c}: {type(exc).__name__}", flush=True)
                continue
            timed.append(dict(kernel=kernel, candidate=list(c), seconds=t))
            print(f"  experts with {kernel} {c}: {t * 1e6:.1f} us", flush=True)
    rows.append(dict(model=name, bound=bound, shipped=shipped, kernels_us=dict(kernels), candidates=timed))
    del problem
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), copy_bandwidth=bw, rows=rows), open(out_path, "w"), indent=1)
