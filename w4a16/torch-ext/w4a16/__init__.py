"""4-bit weight, 16-bit activation matmul (W4A16) in Triton for the Kernel Hub.

int4 (symmetric or with zero points) and NF4 weights in this kernel's own tiled layout (see `formats`),
group sizes 32, 64, 128 (or any multiple of 128) and per-channel, and int4 with a float minimum per group (GGUF
Q4_1 / Q4_K); importers for GPTQ (v1 / v2 zeros, act-order), AWQ, compressed-tensors, bitsandbytes NF4 and GGUF
Q4_0 / Q4_1 / Q4_K (`from_gguf`, `load_gguf`); a GEMV path for decode, a tensor-core path with the
dequantization in the K loop, and dequantize-then-cuBLAS for large M, chosen by M. Quantization by
round-to-nearest (`quantize`, `quantize_model`) or calibrated (GPTQ: `gptq_quantize`,
``quantize_model(..., calibration=...)``); `quantize_model` also fuses the projections that read one input
(q / k / v, gate / up) into one matmul (`fuse_projections`), a SiLU MLP's gate / up with its activation in the
matmul's epilogue (`swiglu_matmul`).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import layers, ops
from .checkpoints import from_pretrained, load_checkpoint, load_gguf
from .formats import NF4_CODEBOOK, QuantizedWeight, load_quantized, quantize, save_quantized
from .gptq import gptq_quantize
from .importers import from_awq, from_bnb_nf4, from_compressed_tensors, from_gguf, from_gptq
from .layers import W4A16Linear, fuse_projections, quantize_model

__all__ = [
    "NF4_CODEBOOK",
    "QuantizedWeight",
    "W4A16Linear",
    "dequantize",
    "from_awq",
    "from_bnb_nf4",
    "from_compressed_tensors",
    "from_gguf",
    "from_gptq",
    "from_pretrained",
    "fuse_projections",
    "gptq_quantize",
    "layers",
    "load_checkpoint",
    "load_gguf",
    "load_quantized",
    "matmul",
    "quantize",
    "quantize_model",
    "save_quantized",
    "swiglu_matmul",
]


def matmul(x: torch.Tensor, qweight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for x ``[..., K]`` float16 / bfloat16 and W the 4-bit weight ``[N, K]``;
    fp32 accumulation, result in x's dtype. Works under torch.compile(fullgraph=True) and CUDA graphs."""
    return ops.matmul(x, qweight, bias)


def swiglu_matmul(x: torch.Tensor, qweight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(gate) * up`` ``[..., N // 2]`` of ``x @ W.T (+ bias)`` for a fused gate / up weight W ``[N, K]`` whose
    rows come in blocks of 8 gate rows, then the same 8 up rows (`fusion.interleave_gate_up`; N a multiple of
    16): computed in the matmul's epilogue from fp32 accumulators and rounded once, so the ``[..., N]`` product
    never reaches memory (dequantize + cuBLAS at large M writes it, then one more kernel applies the epilogue)."""
    return ops.swiglu_matmul(x, qweight, bias)


def dequantize(qweight: QuantizedWeight, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The float weight ``[N, K]`` (original K order) in `dtype`, by default the quantized weight's dtype."""
    return ops.dequantize(qweight, dtype)
