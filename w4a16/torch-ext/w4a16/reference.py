"""The pure-PyTorch path (CPU tensors, the torch-cpu variant): dequantize in fp32, then one matmul."""

from __future__ import annotations

from typing import Optional

import torch

from .formats import unpack


def dequantize_stored(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                      codebook: Optional[torch.Tensor], n: int, k: int, group_size: int) -> torch.Tensor:
    """fp32 ``[n, k]`` weight with its K-columns in stored order (act-order weights stay permuted)."""
    codes = unpack(qweight, (n, k)).long()
    group_of_col = torch.arange(k, device=qweight.device) // (k if group_size == -1 else group_size)
    scale = scales[:, :n].float()[group_of_col].t()
    if codebook is not None:
        values = codebook.float()[codes]
    elif zeros is not None:
        values = codes - zeros[:, :n].long()[group_of_col].t()
    else:
        values = codes - 8
    return values * scale


def dequantize(qweight, scales, zeros, codebook, perm, n, k, group_size, dtype) -> torch.Tensor:
    weight = dequantize_stored(qweight, scales, zeros, codebook, n, k, group_size)
    if perm is not None:
        original = torch.empty_like(weight)
        original[:, perm] = weight
        weight = original
    return weight.to(dtype)


def matmul(x2d: torch.Tensor, qweight, scales, zeros, codebook, bias, n, k, group_size) -> torch.Tensor:
    """``x2d @ W.T (+ bias)`` in fp32, rounded once to x's dtype; `x2d` is already in stored K order."""
    weight = dequantize_stored(qweight, scales, zeros, codebook, n, k, group_size)
    out = x2d.float() @ weight.t()
    if bias is not None:
        out += bias.float()
    return out.to(x2d.dtype)
