"""The mma GEMV's K loop in SASS (`triton_kernels.mma`, `launch._launch_mma`), compiled for sm_90a on a machine
without a GPU (`hubtools.sm90_compile`): instructions an iteration and the opcodes that matter for its
dequantization, for fp16 / bf16 x, symmetric / zero-point int4 g128, at 1 and 16 tokens (docs/design/w4a16.md E77).

    python scripts/publish.py --build-only --out /tmp/bcpu w4a16
    PYTHONPATH=. /tmp/t36/bin/python docs/design/w4a16/sass_mma_loop.py /tmp/bcpu/w4a16 ['{"bias_mma": true}']

(a Python whose Triton is the kernels' release, 3.6). The optional JSON adds keys to the mma plan (4 warps,
4 K-tiles an iteration, a 2-stage ring), e.g. E77's on its branch."""

import json
import sys

import torch

from hubtools.sm90_compile import import_build, start

N = K = 8192
SHOWN = ("HFMA2", "HFMA2.BF16_V2", "HMMA.16816.F32", "HMMA.16816.F32.BF16", "LOP3.LUT", "PRMT", "FFMA", "FMUL",
         "FADD", "IMAD.MOV.U32")


def main(build: str, extra: str = "{}") -> None:
    compiled = start(loops=True)
    launch = import_build(build, "w4a16").triton_kernels.launch
    launch._shared_memory_per_block = lambda index: 232448  # the H100 / H200 opt-in limit
    launch.dependent_launch = lambda plan, device: True
    for dtype in (torch.float16, torch.bfloat16):
        for zero_points in (False, True):
            for m in (1, 16):
                plan = {"num_warps": 4, "split_k": 1, "stages": 2, "tiles": 4, "block_m": 8 if m == 1 else 16,
                        **json.loads(extra)}
                zeros = torch.zeros(K // 128, N, dtype=torch.uint8) if zero_points else None
                x = torch.randn(m, K, dtype=dtype)
                compiled.clear()
                launch._launch_mma(x, torch.zeros(N, K // 8, dtype=torch.int32),
                                   torch.ones(K // 128, N, dtype=torch.float16), zeros, None, None, None,
                                   torch.empty(m, N, dtype=dtype), N, K, 128, plan)
                kernel = compiled[0]
                for counts in kernel["loops"]:
                    shown = {op: counts[op] for op in SHOWN if counts.get(op)}
                    print(f"{str(dtype)[6:]:8s} {'zp' if zero_points else 'sym'} M={m:<2d} {kernel['registers']} "
                          f"registers, loop {sum(counts.values())}: {shown}")


if __name__ == "__main__":
    main(*sys.argv[1:])
