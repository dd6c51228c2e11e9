"""A target program for Nsight Compute: the decode kernels whose bytes move at 50-65 % of copy bandwidth, next to
those at ~87 % and cuBLAS, so the counters can say why (stall reasons, DRAM throughput, occupancy).

Each case is called once to compile and warm up, then once inside the NVTX range "profile", which ncu selects:

    ncu --clock-control none --nvtx --nvtx-include "profile/" --set full -o $OUT/decode \
        python docs/design/ncu_decode_targets.py [w4a16] [moe] [moe16] [mma] [dot] [wgmma] [wgmma1024] [wgmma4096] [nf4]
    ncu --import $OUT/decode.ncu-rep --page details --csv > $OUT/decode-details.csv

Cases: w4a16 at M = 1, fp16, int4 g128, the eight Llama-3 shapes on the shipped launch (the card's table);
70B o with twice the warps per SM (4 warps per program, or 8-row programs); cuBLAS fp16 on the two shapes furthest
apart (70B gate_up at ~87 % of copy, 70B o at ~52 %); moe-dispatch `experts` at T = 1 with int4 g128 experts,
bf16 activations, Mixtral-8x7B and Qwen3-30B-A3B shapes. Run from the repository root with PYTHONPATH=. (needs a
GPU). Kernels are listed in launch order in the report; the case names are printed in the same order.

`mma` (not in the default set): the mma GEMV at M = 16 on the eight shapes and at M = 4 on three, NF4 g64 at
M = 16 on two, cuBLAS fp16 at M = 16 on the same two. `dot`: the tensor-core dot path at M = 256 and cuBLAS beside,
on 8B gate_up and 70B o (issue #12's M = 16 and M = 256 goals are the furthest from their targets). `wgmma`: the
Gluon prefill kernel (128-token tiles, 3 stages, two chunks in flight: E37) at M = 256 on the same two shapes.
`wgmma1024`: the shipped launch at M = 1024 (the table's 256-row wgmma tile on the Llama-3 shapes) on the same two
shapes, cuBLAS fp16 beside; `wgmma4096`: the same at M = 4096 on 8B gate_up and 8B down. `moe16`: moe-dispatch
`experts` at T = 1 with bf16 experts, Mixtral-8x7B and Qwen3-30B-A3B. `nf4`: NF4 g64 on the shipped launch (the
pair table: E73 / E74) beside int4 g128 at M = 1 on 8B qkv, 8B o and 70B down (NF4 / int4 0.63-0.96 on the H100
after E73), at M = 4 / 16 on 8B qkv and 70B down (the mma GEMV; NF4 / int4 0.67-0.70 on the H200, run 177) and at
M = 256 on 8B gate_up and 70B o (the wgmma tile where the table names it).
"""
import sys

import torch

from hubtools.bench import moe_dispatch as mb
from hubtools.bench import w4a16 as wb
from hubtools.build import loaded_kernel
from hubtools.workspace import Workspace

# the shipped launch (the table's 256-row wgmma tile) and cuBLAS fp16 at one M on two shapes: M = 1024; M = 4096 on
# a short-K shape (8B gate_up: 32 K-tiles a block, 81 % of the MMA peak per clock in run 139) and a long-K one
# (8B down: 112 K-tiles, 88 %)
SHIPPED_WGMMA = {"wgmma1024": (1024, ("L3-8B gate_up", "L3-70B o")),
                 "wgmma4096": (4096, ("L3-8B gate_up", "L3-8B down"))}
which = set(sys.argv[1:]) or {"w4a16", "moe"}
cases = []  # (name, fn)
w4a16_project, moe_project = Workspace.load().kernels(["w4a16", "moe-dispatch"])
with loaded_kernel(w4a16_project) as w4a16, loaded_kernel(moe_project) as moe:
    torch.manual_seed(0)
    if "w4a16" in which:
        for label, k, n in wb.SHAPES:
            weight = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
            qw = w4a16.quantize(weight, group_size=wb.GROUP)
            x = torch.randn(1, k, device="cuda", dtype=torch.float16)
            cases.append((f"w4a16 {label} M=1", lambda x=x, qw=qw: w4a16.matmul(x, qw)))
            if label == "L3-70B o":  # the shipped launch with twice the warps per SM, two ways
                shipped = w4a16.tuning.select(1, n, k, x.device)
                for variant in ({"half2": {"num_warps": 4}}, {"half2": {"block_n": 8}}):
                    config = wb._override(shipped, variant)
                    cases.append((f"w4a16 {label} M=1 {variant}", lambda x=x, qw=qw, c=config:
                                  wb._matmul_with(w4a16, x, qw, c)))
            if label in ("L3-70B gate_up", "L3-70B o"):
                cases.append((f"cublas {label} M=1", lambda x=x, w=weight: x @ w.t()))
            else:
                del weight
    if which & {"mma", "dot", "wgmma", *SHIPPED_WGMMA}:
        for label, k, n in wb.SHAPES:
            weight = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
            qw = w4a16.quantize(weight, group_size=wb.GROUP)
            tokens = [16] if "mma" in which else []
            if "mma" in which and label in ("L3-8B qkv", "L3-70B o", "L3-70B down"):
                tokens.append(4)
            if "dot" in which and label in ("L3-8B gate_up", "L3-70B o"):
                tokens.append(256)
            for m in tokens:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                cases.append((f"w4a16 {label} M={m}", lambda x=x, qw=qw: w4a16.matmul(x, qw)))
                if label in ("L3-8B gate_up", "L3-70B o") and m in (16, 256):
                    cases.append((f"cublas {label} M={m}", lambda x=x, w=weight: x @ w.t()))
            if "wgmma" in which and label in ("L3-8B gate_up", "L3-70B o"):
                x = torch.randn(256, k, device="cuda", dtype=torch.float16)
                config = wb._override(dict(w4a16.tuning.select(256, n, k, x.device)),
                                      {"wgmma": {"block_m": 128, "num_stages": 3, "inflight": 2}})
                cases.append((f"w4a16 wgmma {label} M=256", lambda x=x, qw=qw, c=config:
                              wb._matmul_with(w4a16, x, qw, c)))
            for target, (m, labels) in SHIPPED_WGMMA.items():
                if target in which and label in labels:
                    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                    print(label, f"M={m}:", w4a16.tuning.select(m, n, k, x.device), flush=True)
                    cases.append((f"w4a16 {label} M={m}", lambda x=x, qw=qw: w4a16.matmul(x, qw)))
                    cases.append((f"cublas {label} M={m}", lambda x=x, w=weight: x @ w.t()))
            if "mma" in which and label in ("L3-8B qkv", "L3-70B o"):
                nf4 = w4a16.quantize(weight, group_size=wb.NF4_GROUP, fmt="nf4")
                x = torch.randn(16, k, device="cuda", dtype=torch.float16)
                cases.append((f"w4a16 nf4 {label} M=16", lambda x=x, qw=nf4: w4a16.matmul(x, qw)))
    if "nf4" in which:
        nf4_tokens = {"L3-8B qkv": [1, 4, 16], "L3-8B o": [1], "L3-70B down": [1, 4, 16], "L3-8B gate_up": [256],
                      "L3-70B o": [256]}
        for label, k, n in wb.SHAPES:
            tokens = nf4_tokens.get(label, [])
            if not tokens:
                continue
            weight = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
            formats = {"int4": w4a16.quantize(weight, group_size=wb.GROUP),
                       "nf4": w4a16.quantize(weight, group_size=wb.NF4_GROUP, fmt="nf4")}
            for m in tokens:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                for fmt, qw in formats.items():
                    cases.append((f"w4a16 {fmt} {label} M={m}", lambda x=x, qw=qw: w4a16.matmul(x, qw)))
    if "moe" in which:
        spec = mb.QUANT_FORMATS["int4-g128"]
        for name in ("mixtral-8x7b", "qwen3-30b-a3b"):
            model = mb.MODELS[name]
            (layer,) = mb.make_quantized_layers(moe, model, 1, spec)
            case = mb.QuantCase(moe, model, [layer], 1, "int4-g128", mb.quant_expert_bytes(moe, model, spec), seed=3)
            weights, ids = case.routes[0]
            cases.append((f"moe {name} T=1", lambda c=case, l=layer, w=weights, i=ids:
                          moe.fused_experts(c.xs[0], l.w_gate_up, l.w_down, w, i)))
    if "moe16" in which:  # bf16 experts at T = 1: Qwen3-30B-A3B's short-K down kernel beside Mixtral's streaming one
        for name in ("mixtral-8x7b", "qwen3-30b-a3b"):
            model = mb.MODELS[name]
            (layer,) = mb.make_layers(model, 1)
            case = mb.Case(moe, model, [layer], 1, skewed=False, seed=3)
            weights, ids = case.routes[0]
            cases.append((f"moe bf16 {name} T=1", lambda c=case, l=layer, w=weights, i=ids:
                          moe.fused_experts(c.xs[0], l.w_gate_up, l.w_down, w, i)))
    for _, fn in cases:
        fn()
    torch.cuda.synchronize()
    for name, fn in cases:
        torch.cuda.nvtx.range_push("profile")
        fn()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(name, flush=True)
