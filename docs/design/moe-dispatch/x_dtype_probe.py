"""E67 probe: what the packed gate/up GEMV's in-kernel x conversion costs. bf16 activations are scaled to fp16
per 128-column tile inside the K loop (X_SCALED); fp16 activations are used as they are. `experts` at T = 1 with
int4 g128 experts, the same layers and routes, x in bf16 and the same x in fp16, the default plan and the gate/up
GEMV with 8-row programs (half the registers); interleaved CUDA-graph replays over rotated layer copies, then each
kernel's own time (torch.profiler over eager calls). The down GEMV always scales (its x is the fp32 intermediate),
so only the gate/up kernel differs between the dtypes.

    python docs/design/moe-dispatch/x_dtype_probe.py BUILD_DIR OUT.json [model ...]   (env ROUNDS, default 5)
"""
import json
import os
import sys
from pathlib import Path

import kernels
import torch

from hubtools.bench.moe_dispatch import MODELS, QUANT_FORMATS, QUANT_MAX_COPIES, QuantCase, make_quantized_layers, \
    quant_expert_bytes
from hubtools.measure import (environment, kernel_times, measure_copy_bandwidth, rotation_count,
                              time_graphs_interleaved, warm_clocks)

build, out_path, *names = sys.argv[1:]
rounds = int(os.environ.get("ROUNDS", 5))
k = kernels.get_local_kernel(Path(build))
tk = k.ops.triton_kernels
warm_clocks()
copy_bw = measure_copy_bandwidth()
spec = QUANT_FORMATS["int4-g128"]
rows = []
for name in names or ["mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b"]:
    m = MODELS[name]
    expert_bytes = quant_expert_bytes(k, m, spec)
    copies = rotation_count(m.top_k * expert_bytes, max_copies=QUANT_MAX_COPIES)
    layers = make_quantized_layers(k, m, copies, spec)
    case = QuantCase(k, m, layers, 1, "int4-g128", expert_bytes, seed=1)
    default = tk.default_config(1, m.experts, m.hidden, m.intermediate, m.top_k, torch.device("cuda"),
                                quantized=True, packed=True)
    plans = {"default": default, "gate_up-8rows": {**default, "gate_up": {**default["gate_up"], "BLOCK_N": 8}}}
    xs = {"bf16": case.xs, "fp16": [x.half() for x in case.xs]}
    calls, outs = {}, {}
    for dtype, x_list in xs.items():
        out = [torch.empty_like(x) for x in x_list]
        for plan_name, plan in plans.items():
            def fn(i, x_list=x_list, out=out, plan=plan):
                weights, ids = case.routes[i]
                return tk.experts(x_list[i], layers[i].w_gate_up, layers[i].w_down, weights, ids, out[i],
                                  config=plan)
            calls[f"{dtype} {plan_name}"] = fn
    ref = calls["bf16 default"](0).float().clone()
    for v, fn in calls.items():
        err = ((fn(0).float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{name} {v}: relative error {err:.3g} against bf16 default"
    times = dict(zip(calls, time_graphs_interleaved(list(calls.values()), copies, rounds=rounds)))
    bound = case.weight_bytes() / copy_bw
    best = {v: min(t) for v, t in times.items()}
    print(f"{name} T=1 (bound {bound * 1e6:.1f} us): " + ", ".join(
        f"{v} {best[v] * 1e6:.2f} ({bound / best[v]:.2f} of bound)" for v in calls), flush=True)
    profile = {v: kernel_times(fn, copies) for v, fn in calls.items()}
    for v, kt in profile.items():
        print(f"  {v} eager kernels: " + ", ".join(f"{n[:30]} {t:.2f}" for n, t in sorted(kt.items())), flush=True)
    rows.append(dict(model=name, T=1, bound_seconds=bound, plans=plans, seconds=times, kernel_us=profile))
    del layers, case, calls
    torch.cuda.empty_cache()
json.dump(dict(env=environment(["python"] + sys.argv), copy_bandwidth=copy_bw, rows=rows), open(out_path, "w"),
          indent=1)
