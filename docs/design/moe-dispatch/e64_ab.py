"""E64 / E65 A/B: 4-bit experts (int4 g128, bf16 x) on the packed GEMVs with and without the plan keys PDL_TRIGGER,
PRELOAD_WORDS (where the down GEMV is one loop step) and FOLD_COMBINE. `experts` alone as the tuner times it
(rotated layer copies, the benchmark's routed inputs): every variant's output first checked bit-equal to the plan
without the keys, then interleaved CUDA-graph replays (`time_graphs_interleaved`). Then each kernel's own time for
the plan without the keys and the full variant (torch.profiler over eager calls), which says where the time goes.
Run 157 timed the first form of this script (with the refuted "lines" prefetch) at T = 1 and 4.

    python docs/design/moe-dispatch/e64_ab.py BUILD_DIR OUT.json [model ...]   (env ROUNDS, default 7; TOKENS, "1 4";
                                                                               GROUP, the int4 group size, 128)

env VARIANTS='{"name": [{gate_up keys}, {down keys}], ...}' times those instead (any plan keys, over the same base;
"without" is added as the reference).
"""
import json
import os
import sys
from pathlib import Path

import kernels
import torch

from hubtools.bench.moe_dispatch import MODELS
from hubtools.bench.moe_dispatch_tune import _quant_cases
from hubtools.measure import environment, kernel_times, time_graphs_interleaved, warm_clocks

KEYS = {"gate_up": ("PDL_TRIGGER",), "down": ("PRELOAD_WORDS", "FOLD_COMBINE")}
VARIANTS = {  # name: (gate_up keys, down keys), over the default plan without KEYS
    "without": ({}, {}),
    "start": ({"PDL_TRIGGER": "start"}, {}),
    "fold": ({}, {"FOLD_COMBINE": True}),
    "start-preload": ({"PDL_TRIGGER": "start"}, {"PRELOAD_WORDS": True}),
    "start-preload-fold": ({"PDL_TRIGGER": "start"}, {"PRELOAD_WORDS": True, "FOLD_COMBINE": True}),
}
PROFILED = ("without", "start-preload-fold")

build, out_path, *names = sys.argv[1:]
if "VARIANTS" in os.environ:
    VARIANTS = {"without": ({}, {}), **json.loads(os.environ["VARIANTS"])}
    PROFILED = tuple(VARIANTS)
rounds = int(os.environ.get("ROUNDS", 7))
tokens = [int(t) for t in os.environ.get("TOKENS", "1 4").split()]
group = int(os.environ.get("GROUP", 128))
k = kernels.get_local_kernel(Path(build))
tk = k.ops.triton_kernels
# whether experts of this group size run the packed-fp16 GEMVs (`launch.packed_gemv`), asked of a small pair
packed = tk.packed_gemv(k.quantize_experts(torch.randn(1, 2048, 1024), torch.randn(1, 1024, 1024),
                                           group_size=group)[0], torch.bfloat16)
warm_clocks()
rows = []
for name, T, copies, call, ref, bound in _quant_cases(tk, k, names or ["qwen3-30b-a3b"], tokens, group):
    m = MODELS[name]
    default = tk.default_config(T, m.experts, m.hidden, m.intermediate, m.top_k, torch.device("cuda"),
                                quantized=True, packed=packed)
    if not default.get("GEMV"):
        print(f"{name} T={T}: not on the GEMVs", flush=True)
        continue
    base = {part: {key: v for key, v in default[part].items() if key not in KEYS[part]} for part in KEYS}
    one_step = -(-m.intermediate // 128) <= base["down"]["TILES"]
    configs = {v: {**default, "gate_up": {**base["gate_up"], **up}, "down": {**base["down"], **down}}
               for v, (up, down) in VARIANTS.items() if one_step or "PRELOAD_WORDS" not in down}
    configs = {v: c for v, c in configs.items() if v == "without" or c != configs["without"]}
    expected = call(configs["without"])(0).clone()
    for v, config in configs.items():
        got = call(config)(0)
        if "VARIANTS" in os.environ:  # other block sizes may sum in another order: within bf16's rounding
            err = ((got.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"{name} T={T} {v}: relative error {err:.3g}"
        else:
            assert torch.equal(got, expected), f"{name} T={T} {v}: not bit-equal to the plan without keys"
    times = dict(zip(configs, time_graphs_interleaved([call(c) for c in configs.values()], copies, rounds=rounds)))
    best = {v: min(t) for v, t in times.items()}
    print(f"{name} T={T} (bound {bound * 1e6:.1f} us): " + ", ".join(
        f"{v} {best[v] * 1e6:.2f} ({best['without'] / best[v]:.3f}x)" for v in configs), flush=True)
    profile = {v: kernel_times(call(configs[v]), copies) for v in PROFILED if v in configs}
    for v, kt in profile.items():
        print(f"  {v} eager kernels: " + ", ".join(f"{n[:40]} {t:.2f}" for n, t in sorted(kt.items())), flush=True)
    rows.append(dict(model=name, T=T, bound_seconds=bound, configs=configs, seconds=times, kernel_us=profile))
json.dump(dict(env=environment(["python"] + sys.argv), rows=rows), open(out_path, "w"), indent=1)
