"""torch.library registration: the ops, their fake (meta) kernels, autograd, and the Triton/PyTorch dispatch.

Dispatch: the Triton path when triton is importable and the tensor is not on the CPU, or when
TRITON_INTERPRET=1 (the Triton interpreter runs the kernels on CPU tensors); else `reference.py`.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Optional

import torch

from . import reference
from ._ops import add_op_namespace_prefix

if importlib.util.find_spec("triton") is not None:
    from . import triton_kernels
else:
    triton_kernels = None

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _use_triton(x: torch.Tensor) -> bool:
    return triton_kernels is not None and (x.device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1")


def check_argument_types(x, residual, weight, eps, offset, inplace=False, *, needs_residual=False) -> None:
    """TypeError naming the argument, before the dispatcher rejects it with a generic RuntimeError."""
    for name, value, optional in (("x", x, False), ("residual", residual, not needs_residual), ("weight", weight, True)):
        if not isinstance(value, torch.Tensor) and not (optional and value is None):
            raise TypeError(f"{name} must be a torch.Tensor{' or None' if name == 'weight' else ''}, "
                            f"got {type(value).__name__}")
    for name, value in (("eps", eps), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")


def _check_inputs(x, residual, weight, eps, offset) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalized one)")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual must have the dtype of x ({x.dtype}), got {residual.dtype}")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}")
    if weight is not None:
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise ValueError(f"weight must have shape ({x.shape[-1]},) (the last dim of x), got {tuple(weight.shape)}")
        if weight.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"weight must be float32, float16 or bfloat16, got {weight.dtype}")
        if weight.device != x.device:
            raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    elif offset != 0.0:
        raise ValueError(f"offset={offset} needs a weight: offset + weight is the scale")
    if not 0.0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")


def output_dtype(x: torch.Tensor, weight: Optional[torch.Tensor], offset: float) -> torch.dtype:
    """Llama (offset 0) returns `weight * normed`, so the dtypes promote; Gemma casts back to x's dtype."""
    if weight is not None and offset == 0.0:
        return torch.promote_types(x.dtype, weight.dtype)
    return x.dtype


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A [rows, cols] view with contiguous columns, or one contiguous copy when the layout has none."""
    rows = t.reshape(-1, t.shape[-1])
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def _contiguous(weight: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return weight.contiguous() if weight is not None else None


@torch.library.custom_op(add_op_namespace_prefix("rms_norm"), mutates_args=())
def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float) -> torch.Tensor:
    _check_inputs(x, None, weight, eps, offset)
    dtype = output_dtype(x, weight, offset)
    if not _use_triton(x):
        return reference.rms_norm(x, weight, eps, offset, dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if out.numel() > 0:
        triton_kernels.forward(_as_rows(x), None, _contiguous(weight), out.view(-1, x.shape[-1]), None, eps, offset)
    return out


@torch.library.register_fake(add_op_namespace_prefix("rms_norm"))
def _rms_norm_fake(x, weight, eps, offset):
    _check_inputs(x, None, weight, eps, offset)
    return x.new_empty(x.shape, dtype=output_dtype(x, weight, offset))


@torch.library.custom_op(add_op_namespace_prefix("fused_add_rms_norm"), mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                       offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(x, residual, weight, eps, offset)
    dtype = output_dtype(x, weight, offset)
    if not _use_triton(x):
        return reference.fused_add_rms_norm(x, residual, weight, eps, offset, dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        n_cols = x.shape[-1]
        triton_kernels.forward(_as_rows(x), _as_rows(residual), _contiguous(weight), out.view(-1, n_cols),
                               total.view(-1, n_cols), eps, offset)
    return out, total


@torch.library.register_fake(add_op_namespace_prefix("fused_add_rms_norm"))
def _fused_add_rms_norm_fake(x, residual, weight, eps, offset):
    _check_inputs(x, residual, weight, eps, offset)
    return x.new_empty(x.shape, dtype=output_dtype(x, weight, offset)), x.new_empty(x.shape)


def _check_inplace(x, residual, weight, eps, offset) -> None:
    _check_inputs(x, residual, weight, eps, offset)
    if output_dtype(x, weight, offset) != x.dtype:
        raise TypeError(f"inplace=True writes the output into x ({x.dtype}), but a {weight.dtype} weight "
                        f"makes it {output_dtype(x, weight, offset)}")


@torch.library.custom_op(add_op_namespace_prefix("fused_add_rms_norm_inplace"), mutates_args=("x", "residual"))
def fused_add_rms_norm_inplace(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                               offset: float) -> None:
    """residual <- x + residual and x <- rms_norm(x + residual), allocating nothing for contiguous inputs."""
    _check_inplace(x, residual, weight, eps, offset)
    if x.numel() == 0:
        return
    if not _use_triton(x):
        out, total = reference.fused_add_rms_norm(x, residual, weight, eps, offset, x.dtype)
        residual.copy_(total)
        x.copy_(out)
        return
    x_rows, residual_rows = _as_rows(x), _as_rows(residual)
    triton_kernels.forward(x_rows, residual_rows, _contiguous(weight), x_rows, residual_rows, eps, offset)
    # Layouts that are not row views were computed in copies: write them back.
    if x_rows.data_ptr() != x.data_ptr():
        x.copy_(x_rows.view(x.shape))
    if residual_rows.data_ptr() != residual.data_ptr():
        residual.copy_(residual_rows.view(residual.shape))


@torch.library.register_fake(add_op_namespace_prefix("fused_add_rms_norm_inplace"))
def _fused_add_rms_norm_inplace_fake(x, residual, weight, eps, offset):
    _check_inplace(x, residual, weight, eps, offset)


@torch.library.custom_op(add_op_namespace_prefix("rms_norm_backward"), mutates_args=())
def rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                      grad_sum: Optional[torch.Tensor], eps: float, offset: float,
                      weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx + grad_sum, dw) of rms_norm(x, weight); dw is empty unless weight_grad."""
    if not _use_triton(x):
        grad_x, grad_weight = reference.rms_norm_backward(grad_out, x, weight, grad_sum, eps, offset, weight_grad)
        return grad_x, grad_weight if weight_grad else x.new_empty(0)
    n_cols = x.shape[-1]
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grad_weight = torch.empty(n_cols, dtype=weight.dtype, device=x.device) if weight_grad else x.new_empty(0)
    if x.numel() == 0:
        return grad_x, grad_weight.zero_()
    triton_kernels.backward(
        _as_rows(grad_out), _as_rows(x), _contiguous(weight), _as_rows(grad_sum) if grad_sum is not None else None,
        grad_x.view(-1, n_cols), grad_weight if weight_grad else None, eps, offset)
    return grad_x, grad_weight


@torch.library.register_fake(add_op_namespace_prefix("rms_norm_backward"))
def _rms_norm_backward_fake(grad_out, x, weight, grad_sum, eps, offset, weight_grad):
    grad_weight = weight.new_empty(weight.shape) if weight_grad else x.new_empty(0)
    return x.new_empty(x.shape), grad_weight


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps, offset = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.offset = eps, offset


def _rms_norm_autograd(ctx, grad_out):
    x, weight = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[1]
    grad_x, grad_weight = rms_norm_backward(grad_out, x, weight, None, ctx.eps, ctx.offset, weight_grad)
    return grad_x, grad_weight if weight_grad else None, None, None


torch.library.register_autograd(
    add_op_namespace_prefix("rms_norm"), _rms_norm_autograd, setup_context=_rms_norm_setup_context)


def _fused_add_rms_norm_setup_context(ctx, inputs, output):
    _, _, weight, eps, offset = inputs
    # The backward needs x + residual, which is the second output.
    ctx.save_for_backward(output[1], weight)
    ctx.eps, ctx.offset = eps, offset


def _fused_add_rms_norm_autograd(ctx, grad_out, grad_total):
    total, weight = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[2]
    grad_x, grad_weight = rms_norm_backward(grad_out, total, weight, grad_total, ctx.eps, ctx.offset, weight_grad)
    return grad_x, grad_x, grad_weight if weight_grad else None, None, None


torch.library.register_autograd(
    add_op_namespace_prefix("fused_add_rms_norm"), _fused_add_rms_norm_autograd,
    setup_context=_fused_add_rms_norm_setup_context)
