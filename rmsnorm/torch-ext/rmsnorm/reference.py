"""The pure-PyTorch path: what runs on CPU tensors (the torch-cpu variant, where there is no Triton).

The same semantics as the Triton kernels: fp32 statistics; with offset == 0 (Llama) the normalized value
is rounded to the input dtype before the weight multiply, otherwise (Gemma) x * rstd * (offset + w) is
computed in fp32 and rounded once.
"""

from __future__ import annotations

import torch


def _normalized(xf: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * rstd, rstd


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
             out_dtype: torch.dtype) -> torch.Tensor:
    xhat, _ = _normalized(x.float(), eps)
    if weight is None:
        return xhat.to(out_dtype)
    if offset == 0.0:
        return (weight.float() * xhat.to(x.dtype).float()).to(out_dtype)
    return (xhat * (offset + weight.float())).to(out_dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       offset: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rms_norm(total, weight, eps, offset, out_dtype), total


def rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                      grad_sum: torch.Tensor | None, eps: float, offset: float,
                      weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx [+ grad_sum], dw or None) for y = rms_norm(x, weight)."""
    xhat, rstd = _normalized(x.float(), eps)
    dy = grad_out.float()
    g = dy
    if weight is not None:
        g = dy * (weight.float() if offset == 0.0 else offset + weight.float())
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if grad_sum is not None:
        dx = dx + grad_sum.float()
    dw = None
    if weight_grad:
        used = xhat.to(x.dtype).float() if offset == 0.0 else xhat
        dw = (dy * used).reshape(x.shape[:-1].numel(), x.shape[-1]).sum(0).to(weight.dtype)
    return dx.to(x.dtype), dw
