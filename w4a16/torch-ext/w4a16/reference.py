"""The pure-PyTorch path (CPU tensors, the torch-cpu variant): dequantize in fp32, then one matmul."""

from __future__ import annotations

from typing import Optional

import torch

from .formats import GATE_UP_BLOCK, unpack


def dequantize_stored(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                      mins: Optional[torch.Tensor], codebook: Optional[torch.Tensor], n: int, k: int,
                      group_size: int) -> torch.Tensor:
    """fp32 ``[n, k]`` weight with its K-columns in stored order (act-order weights stay permuted). The group
    parameters broadcast over a ``[n, groups, group_size]`` view of the codes (no per-column gather)."""
    width = k if group_size == -1 else group_size
    groups = k // width
    codes = unpack(qweight, (n, k)).view(n, groups, width)

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [G, Np] -> fp32 [n, groups, 1]
        return t[:groups, :n].t().unsqueeze(-1).float()

    if codebook is not None:
        values = codebook.float()[codes.long()]
    elif zeros is not None:
        values = codes.float() - per_group(zeros)
    elif mins is not None:
        return (codes.float() * per_group(scales) + per_group(mins)).view(n, k)
    else:
        values = codes.float() - 8
    return (values * per_group(scales)).view(n, k)


def dequantize(qweight, scales, zeros, mins, codebook, perm, n, k, group_size, dtype) -> torch.Tensor:
    weight = dequantize_stored(qweight, scales, zeros, mins, codebook, n, k, group_size)
    if perm is not None:
        original = torch.empty_like(weight)
        original[:, perm] = weight
        weight = original
    return weight.to(dtype)


def _matmul_fp32(x2d, qweight, scales, zeros, mins, codebook, bias, n, k, group_size) -> torch.Tensor:
    weight = dequantize_stored(qweight, scales, zeros, mins, codebook, n, k, group_size)
    out = x2d.float() @ weight.t()
    if bias is not None:
        out += bias.float()
    return out


def matmul(x2d: torch.Tensor, qweight, scales, zeros, mins, codebook, bias, n, k, group_size) -> torch.Tensor:
    """``x2d @ W.T (+ bias)`` in fp32, rounded once to x's dtype; `x2d` is already in stored K order."""
    return _matmul_fp32(x2d, qweight, scales, zeros, mins, codebook, bias, n, k, group_size).to(x2d.dtype)


def split_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up columns ``[..., I]`` of a fused output ``[..., 2 I]`` whose columns come in blocks of
    GATE_UP_BLOCK gate columns, then as many up columns (the inverse of `join_gate_up`)."""
    gate, up = fused.unflatten(-1, (-1, 2, GATE_UP_BLOCK)).unbind(-2)
    return gate.flatten(-2), up.flatten(-2)


def join_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[..., I]`` gate and up (I a multiple of GATE_UP_BLOCK) as one ``[..., 2 I]`` in the SwiGLU layout:
    column 16 b + i is gate column 8 b + i, column 16 b + 8 + i the up column 8 b + i."""
    blocks = (t.unflatten(-1, (-1, GATE_UP_BLOCK)) for t in (gate, up))
    return torch.stack(tuple(blocks), dim=-2).flatten(-3)


def swiglu_matmul(x2d: torch.Tensor, qweight, scales, zeros, mins, codebook, bias, n, k, group_size) -> torch.Tensor:
    """``silu(gate) * up`` ``[M, n // 2]`` of ``x2d @ W.T (+ bias)`` for a weight in the SwiGLU layout, all in fp32
    and rounded once to x's dtype, as the kernels' epilogue does."""
    gate, up = split_gate_up(_matmul_fp32(x2d, qweight, scales, zeros, mins, codebook, bias, n, k, group_size))
    return (torch.nn.functional.silu(gate) * up).to(x2d.dtype)
