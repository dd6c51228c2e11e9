"""RMSNorm and fused residual-add RMSNorm in Triton, forward and backward, for the Kernel Hub.

Semantics follow `transformers`: fp32 statistics; with `offset=0.0` the normalized value is cast to the
input dtype and then multiplied by the weight (`LlamaRMSNorm`); with `offset=1.0` the scale is
`1 + weight` applied in fp32 before one cast (`GemmaRMSNorm`, transformers' "RMSNormZeroCentered").
`fuse_residual_norms` rewires a `transformers` decoder so that each residual add runs fused with the norm after it.
"""

from __future__ import annotations

import torch

from . import layers, ops, residual_norms
from .residual_norms import fuse_residual_norms

__all__ = ["fuse_residual_norms", "fused_add_rms_norm", "layers", "residual_norms", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any leading dims). `weight=None` means no scale.

    The result has x's dtype, except with `offset=0.0` and a weight of another dtype, where it has the
    promoted dtype as `weight * normed` does in `LlamaRMSNorm`. Differentiable in x and weight.
    """
    ops.check_argument_types(x, None, weight, eps, offset)
    return ops.rms_norm(x, weight, eps, offset)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)` in one pass over memory; the sum is rounded to x's dtype.

    With `inplace=True` (the vLLM convention) the sum is written into `residual`, the normalized output
    into `x`, and `(x, residual)` is returned; it has no autograd, so inputs must not require grad.
    """
    ops.check_argument_types(x, residual, weight, eps, offset, inplace, needs_residual=True)
    if not inplace:
        return ops.fused_add_rms_norm(x, residual, weight, eps, offset)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual, weight)):
        raise ValueError("inplace=True has no autograd: call it under torch.no_grad() / inference_mode(), "
                         "or use inplace=False")
    ops.fused_add_rms_norm_inplace(x, residual, weight, eps, offset)
    return x, residual
