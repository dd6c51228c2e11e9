"""The K loop's SASS of the 4-bit packed GEMVs (`_gate_up_h2_kernel`, `_down_h2_kernel`), compiled for sm_90a on a
machine without a GPU (`hubtools.sm90_compile`), as an opcode histogram per loop iteration.

    python scripts/publish.py --build-only --out /tmp/bcpu moe-dispatch
    PYTHONPATH=. /tmp/t36/bin/python docs/design/moe-dispatch/sass_gate_up_loop.py /tmp/bcpu/moe-dispatch [bfloat16]

(a Python whose Triton is the kernels' release, 3.6). Mixtral-8x7B expert shapes, int4 g128 symmetric, T = 1, the
packed plan of `configs.default_config` (16 rows x 8 tiles, 2 warps, 3-stage TMA ring, x broadcast); loops as
`hubtools.sm90_compile.loop_opcodes` finds them."""

import sys

import torch

from hubtools.sm90_compile import import_build, start

E, H, I, TOP_K, T = 8, 4096, 14336, 2, 1
PLAN = {"BLOCK_N": 16, "BLOCK_K": 128, "TILES": 8, "num_warps": 2, "num_stages": 3, "X_BCAST": True, "TMA": True,
        "PDL": True}


def main(build: str, dtype: str = "bfloat16") -> None:
    compiled = start(loops=True)
    package = import_build(build, "moe_dispatch")
    launch = package.triton_kernels.launch
    launch._pdl_device = lambda device: True  # the CPU tensors' device stands in for an sm_90 GPU
    launch._capability = lambda device: (9, 0)

    def experts(n, k, group=128):
        return package.quantized.QuantizedExperts(
            qweight=torch.zeros(E, n, k // 8, dtype=torch.int32),
            scales=torch.ones(E, k // group, n, dtype=torch.float16), zeros=None, mins=None, group_size=group,
            shape=(n, k))

    x = torch.randn(T, H, dtype=getattr(torch, dtype))
    launch._gemvs(x, experts(2 * I, H), experts(H, I), torch.rand(T, TOP_K), torch.zeros(T, TOP_K, dtype=torch.int32),
                  PLAN, PLAN, torch.empty(T, H, dtype=x.dtype))
    for kernel in compiled:
        for counts in kernel["loops"]:
            print(f"{kernel['kernel']}: loop of {sum(counts.values())} instructions, {kernel['registers']} registers")
            for op, count in sorted(counts.items(), key=lambda item: -item[1])[:16]:
                print(f"  {count:5d} {op}")


if __name__ == "__main__":
    main(*sys.argv[1:])
