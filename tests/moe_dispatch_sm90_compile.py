"""moe-dispatch's sm_90a compile cases (`hubtools.sm90_compile`): `python moe_dispatch_sm90_compile.py BUILD CASES`,
CASES a JSON list of ``[fmt, group_size, dtype, block_m, num_stages]`` (fmt: ``"int4"``, ``"zp"`` or ``"mins"``;
dtype: ``"float16"`` or ``"bfloat16"``), each run through the grouped Gluon launcher (`launch._grouped_wgmma`:
the row gather, then the gate / up and the down kernel) on Qwen3-30B-A3B's expert shapes, or of
``["mma", fmt, group_size, dtype, plan]``, run through the tensor-core GEMVs' launchers (`launch._gate_up_mma`,
`launch._down_mma`) at one token (the plan's "FOLD_COMBINE": the gate/up GEMV zeroes the fold's counts). Run by `test_moe_dispatch_sm90_compile.py`."""

from __future__ import annotations

import json
import sys

import torch

from hubtools.sm90_compile import import_build, report, start

E, H, I, TOP_K, T = 8, 2048, 768, 2, 512


def _experts(quantized, fmt: str, group_size: int, n: int, k: int):
    """4-bit experts of a format's shapes (values do not matter: nothing runs)."""
    groups = 1 if group_size == -1 else k // group_size
    return quantized.QuantizedExperts(
        qweight=torch.zeros(E, n, k // 8, dtype=torch.int32), scales=torch.ones(E, groups, n, dtype=torch.float16),
        zeros=torch.zeros(E, groups, n, dtype=torch.uint8) if fmt == "zp" else None,
        mins=torch.zeros(E, groups, n, dtype=torch.float16) if fmt == "mins" else None,
        group_size=group_size, shape=(n, k))


def main(build: str, cases: str) -> None:
    compiled = start()
    package = import_build(build, "moe_dispatch")
    launch = package.triton_kernels.launch
    for case in json.loads(cases):
        if case[0] == "mma":
            _, fmt, group_size, dtype, plan = case
            w_gate_up = _experts(package.quantized, fmt, group_size, 2 * I, H)
            w_down = _experts(package.quantized, fmt, group_size, H, I)
            x = torch.randn(1, H, dtype=getattr(torch, dtype))
            ids = torch.zeros(1, TOP_K, dtype=torch.int32)

            def both():  # with FOLD_COMBINE in the plan the gate/up GEMV zeroes a token's 4 fold counts
                launch._gate_up_mma(x, w_gate_up, torch.empty(TOP_K, I), ids, plan, False,
                                    torch.empty(4, dtype=torch.int32), 4 if plan.get("FOLD_COMBINE") else 0)
                launch._down_mma(torch.empty(TOP_K, I, dtype=x.dtype), w_down, ids, torch.rand(1, TOP_K), plan)

            report(compiled, both)
            continue
        fmt, group_size, dtype, block_m, stages = case
        w_gate_up = _experts(package.quantized, fmt, group_size, 2 * I, H)
        w_down = _experts(package.quantized, fmt, group_size, H, I)
        x = torch.randn(T, H, dtype=getattr(torch, dtype))
        blocks = T * TOP_K // block_m + E
        report(compiled, lambda: launch._grouped_wgmma(
            x, w_gate_up, w_down, torch.rand(T, TOP_K), torch.zeros(blocks * block_m, dtype=torch.int32),
            torch.zeros(blocks, dtype=torch.int32), torch.empty(blocks * block_m, I, dtype=x.dtype), TOP_K, block_m,
            {"num_stages": stages}))


if __name__ == "__main__":
    main(*sys.argv[1:])
