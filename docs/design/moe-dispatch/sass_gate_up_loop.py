"""The K loop's SASS of the 4-bit decode GEMVs (the packed `_gate_up_h2_kernel` / `_down_h2_kernel`, or with a
plan's "MMA" the tensor-core `_gate_up_mma_kernel` / `_down_mma_kernel`), compiled for sm_90a on a machine without
a GPU (`hubtools.sm90_compile`), as an opcode histogram per loop iteration and instructions a weight a thread.

    python scripts/publish.py --build-only --out /tmp/bcpu moe-dispatch
    PYTHONPATH=. /tmp/t36/bin/python docs/design/moe-dispatch/sass_gate_up_loop.py /tmp/bcpu/moe-dispatch \\
        [bfloat16 [GATE_UP_PLAN_JSON [DOWN_PLAN_JSON [zp]]]]

(a Python whose Triton is the kernels' release, 3.6). Mixtral-8x7B expert shapes, int4 g128 (symmetric, or with
zero points: `zp`), T = 1; the plans default to the packed plan of `configs.default_config` (16 rows x 8 tiles, 2
warps, 3-stage TMA ring, x broadcast); loops as `hubtools.sm90_compile.loop_opcodes` finds them."""

import json
import sys

import torch

from hubtools.sm90_compile import import_build, start

E, H, I, TOP_K, T = 8, 4096, 14336, 2, 1
PLAN = {"BLOCK_N": 16, "BLOCK_K": 128, "TILES": 8, "num_warps": 2, "num_stages": 3, "X_BCAST": True, "TMA": True,
        "PDL": True}


def weights_a_thread(kernel: str, plan: dict) -> int:
    """The weights one loop iteration of `kernel` under `plan` takes per thread."""
    tiles, warps = plan.get("TILES", 4), plan.get("num_warps", 4)
    rows = {"_gate_up_h2_kernel": 2 * plan.get("BLOCK_N", 16), "_down_h2_kernel": plan.get("BLOCK_N", 16),
            "_gate_up_mma_kernel": 2 * 16 * warps, "_down_mma_kernel": 16 * warps * plan.get("REPS", 1)}[kernel]
    return rows * 128 * tiles // (32 * warps)


def main(build: str, dtype: str = "bfloat16", gate_up: str = "null", down: str = "null", fmt: str = "sym") -> None:
    up_plan, down_plan = json.loads(gate_up) or PLAN, json.loads(down) or PLAN
    compiled = start(loops=True)
    package = import_build(build, "moe_dispatch")
    launch = package.triton_kernels.launch
    launch._pdl_device = lambda device: True  # the CPU tensors' device stands in for an sm_90 GPU
    launch._capability = lambda device: (9, 0)
    launch.mma_gemv_supported = lambda x, w: True

    def experts(n, k, group=128):
        return package.quantized.QuantizedExperts(
            qweight=torch.zeros(E, n, k // 8, dtype=torch.int32),
            scales=torch.ones(E, k // group, n, dtype=torch.float16),
            zeros=torch.zeros(E, k // group, n, dtype=torch.uint8) if fmt == "zp" else None, mins=None,
            group_size=group, shape=(n, k))

    x = torch.randn(T, H, dtype=getattr(torch, dtype))
    launch._gemvs(x, experts(2 * I, H), experts(H, I), torch.rand(T, TOP_K), torch.zeros(T, TOP_K, dtype=torch.int32),
                  up_plan, down_plan, torch.empty(T, H, dtype=x.dtype))
    for kernel, plan in zip(compiled, (up_plan, down_plan)):
        for counts in kernel["loops"]:
            total = sum(counts.values())
            print(f"{kernel['kernel']}: loop of {total} instructions, "
                  f"{total / weights_a_thread(kernel['kernel'], plan):.2f} a weight, {kernel['registers']} registers, "
                  f"{kernel['shared']} bytes of shared memory")
            for op, count in sorted(counts.items(), key=lambda item: -item[1])[:16]:
                print(f"  {count:5d} {op}")


if __name__ == "__main__":
    main(*sys.argv[1:])
