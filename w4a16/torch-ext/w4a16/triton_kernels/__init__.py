"""Triton kernels and their launchers: GEMV / split-K on CUDA cores for a few tokens, tl.dot with the
dequantization inside the K loop for more, a dequantize kernel (for dequantize-then-cuBLAS at large M),
and the deterministic split-K reduction.

Dequantization never converts int -> float (a low-throughput instruction on Hopper): OR-ing a 4-bit field
into the mantissa of 2**23 (bits 0x4B000000) and reading the word as fp32 gives exactly 2**23 + field,
so one AND-OR and one FADD give ``code - zero``. In the GEMV the field is masked in place, without a
shift, which multiplies it by 16**i; x is pre-scaled by 16**-i (exact) instead. The dot path's int4 operands
are built in fp16 / bf16 pairs directly (`_unit_pair`).
All accumulation is fp32 (the packed-fp16 GEMV, `_gemv_h2_kernel`, sums 8 products in fp16 before that);
offsets that scale with M, N or K are 64-bit.

Modules: `gemv` (CUDA-core GEMV / split-K for a few tokens: the fp32 `_gemv_kernel` and the packed-fp16
`_gemv_h2_kernel`), `dot` (tensor cores, dequantization in the K loop), `wgmma` (Hopper only, in Gluon: a TMA
loader warp beside one or two warpgroups dequantizing into the register operand of asynchronous wgmma; its
chains' int4 operand in `wgmma_chunks`), `warp_specialize` (the edit of Triton 3.6's warp-specialized PTX that
lets `wgmma`'s second warpgroup pipeline), `mma` (the tensor-core GEMV for 2-32 tokens, in Gluon: `mma.sync`
on operands dequantized in registers; its K loop in `mma_gemv`, NF4's lookups in `mma` itself), `dequant` (the
dequantize kernel), `common` (bit tricks and the split-K reduction they share), `launch` (grids,
configs, the entry points below). `warp_specialize`, `wgmma_chunks` and `mma_gemv` are shared with moe-dispatch
byte for byte.
"""

from .launch import dequantize, matmul

__all__ = ["dequantize", "matmul"]
