"""float64 references shared by the CPU and GPU test files (written independently of the kernels' code)."""

from __future__ import annotations

import torch


def rms_norm_reference(x, weight, eps=1e-6, offset=0.0, residual=None):
    """float64 (out, x + residual) with the kernel's rounding points: Llama semantics (offset 0) round
    x * rstd to the input dtype before the weight multiply; Gemma (offset 1) rounds once at the end."""
    total = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    xd = total.double()
    xhat = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return xhat, total
    if offset == 0.0:
        return weight.double() * xhat.to(x.dtype).double(), total
    return xhat * (offset + weight.double()), total
