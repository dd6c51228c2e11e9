"""torch.library registration: the matmul, SwiGLU matmul and dequantize ops, their fake kernels, autograd, and the
dispatch (Triton or PyTorch; then, on the Triton path, a kernel chosen by M through `tuning`).

Dispatch: the Triton path when triton is importable and the tensor is not on the CPU, or when
TRITON_INTERPRET=1 (the Triton interpreter runs the kernels on CPU tensors); else `reference.py`.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from . import reference, tuning
from ._ops import add_op_namespace_prefix
from .formats import QuantizedWeight, check_swiglu_rows

if importlib.util.find_spec("triton") is not None:
    from . import triton_kernels
else:
    triton_kernels = None

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)


def _use_triton(x: torch.Tensor) -> bool:
    return triton_kernels is not None and (x.device.type != "cpu" or tuning.interpreting())


def check_activation(x, shape: tuple[int, int], device: torch.device, bias) -> None:
    """x [..., K] float16/bfloat16 and bias [N] (or None) against a weight of `shape` (N, K) on `device`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"x must be float16 or bfloat16, got {x.dtype}")
    n, k = shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must have shape [..., {k}] (in_features of the weight), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"x is on {x.device} but the weight is on {device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (n,):
            raise ValueError(f"bias must have shape ({n},) (out_features), got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias must have x's dtype ({x.dtype}), got {bias.dtype}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")


def _rows(x: torch.Tensor, k: int, perm: Optional[torch.Tensor]) -> torch.Tensor:
    """x as [M, K] with unit column stride, in stored K order (act-order weights permute K)."""
    rows = x.reshape(-1, k)
    if perm is not None:
        return rows.index_select(1, perm)
    return rows if rows.stride(1) == 1 else rows.contiguous()


@torch.library.custom_op(add_op_namespace_prefix("matmul"), mutates_args=())
def matmul_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
              mins: Optional[torch.Tensor], codebook: Optional[torch.Tensor], perm: Optional[torch.Tensor],
              bias: Optional[torch.Tensor], n: int, k: int, group_size: int) -> torch.Tensor:
    rows = _rows(x, k, perm)
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n)
    if _use_triton(x):
        config = tuning.select(rows.shape[0], n, k, x.device, nf4_group=None if codebook is None else group_size)
        out = triton_kernels.matmul(rows, qweight, scales, zeros, codebook, bias, n, k, group_size, config,
                                    mins=mins)
    else:
        out = reference.matmul(rows, qweight, scales, zeros, mins, codebook, bias, n, k, group_size)
    return out.view(*x.shape[:-1], n)


@torch.library.register_fake(add_op_namespace_prefix("matmul"))
def _matmul_fake(x, qweight, scales, zeros, mins, codebook, perm, bias, n, k, group_size):
    return x.new_empty(*x.shape[:-1], n)


@torch.library.custom_op(add_op_namespace_prefix("swiglu_matmul"), mutates_args=())
def swiglu_matmul_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     mins: Optional[torch.Tensor], codebook: Optional[torch.Tensor], perm: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], n: int, k: int, group_size: int) -> torch.Tensor:
    """``silu(gate) * up`` ``[..., n // 2]`` of ``x @ W.T (+ bias)`` for a fused gate / up weight W in the SwiGLU
    layout (`formats.GATE_UP_BLOCK`), computed from the fp32 accumulators and rounded once."""
    rows = _rows(x, k, perm)
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n // 2)
    if _use_triton(x):
        config = tuning.select(rows.shape[0], n, k, x.device, nf4_group=None if codebook is None else group_size)
        out = triton_kernels.matmul(rows, qweight, scales, zeros, codebook, bias, n, k, group_size, config,
                                    swiglu=True, mins=mins)
    else:
        out = reference.swiglu_matmul(rows, qweight, scales, zeros, mins, codebook, bias, n, k, group_size)
    return out.view(*x.shape[:-1], n // 2)


@torch.library.register_fake(add_op_namespace_prefix("swiglu_matmul"))
def _swiglu_matmul_fake(x, qweight, scales, zeros, mins, codebook, perm, bias, n, k, group_size):
    return x.new_empty(*x.shape[:-1], n // 2)


@torch.library.custom_op(add_op_namespace_prefix("dequantize"), mutates_args=())
def dequantize_op(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                  mins: Optional[torch.Tensor], codebook: Optional[torch.Tensor], perm: Optional[torch.Tensor], n: int,
                  k: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    if not _use_triton(qweight):
        return reference.dequantize(qweight, scales, zeros, mins, codebook, perm, n, k, group_size, dtype)
    weight = triton_kernels.dequantize(qweight, scales, zeros, codebook, n, k, group_size, dtype, mins=mins)
    if perm is None:
        return weight
    original = torch.empty_like(weight)
    original[:, perm] = weight
    return original


@torch.library.register_fake(add_op_namespace_prefix("dequantize"))
def _dequantize_fake(qweight, scales, zeros, mins, codebook, perm, n, k, group_size, dtype):
    return qweight.new_empty(n, k, dtype=dtype)


def _matmul_setup_context(ctx, inputs, output):
    x, qweight, scales, zeros, mins, codebook, perm, bias, n, k, group_size = inputs
    ctx.save_for_backward(qweight, scales, zeros, mins, codebook, perm)
    ctx.shape = (n, k, group_size)
    ctx.bias_shape = None if bias is None else bias.shape


def _matmul_backward(ctx, grad):
    """d/dx (x @ W.T + b) = grad @ W with W dequantized in grad's dtype; the weight gets no gradient."""
    qweight, scales, zeros, mins, codebook, perm = ctx.saved_tensors[:6]
    n, k, group_size = ctx.shape
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        weight = dequantize_op(qweight, scales, zeros, mins, codebook, perm, n, k, group_size, grad.dtype)
        grad_x = grad @ weight
    if ctx.bias_shape is not None and ctx.needs_input_grad[7]:
        grad_bias = grad.reshape(-1, n).sum(0)
    return grad_x, None, None, None, None, None, None, grad_bias, None, None, None


matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup_context)


def _swiglu_matmul_setup_context(ctx, inputs, output):
    x, qweight, scales, zeros, mins, codebook, perm, bias, n, k, group_size = inputs
    ctx.save_for_backward(qweight, scales, zeros, mins, codebook, perm, x, bias)
    ctx.shape = (n, k, group_size)
    ctx.bias_shape = None if bias is None else bias.shape


def _swiglu_matmul_backward(ctx, grad):
    """The fused rows recomputed by the matmul (the forward keeps none), the SwiGLU's derivatives in fp32
    (silu'(g) = s (1 + g (1 - s)), s = sigmoid(g)) joined back into the fused layout, then `_matmul_backward`."""
    qweight, scales, zeros, mins, codebook, perm, x, bias = ctx.saved_tensors
    n, k, group_size = ctx.shape
    fused = matmul_op(x, qweight, scales, zeros, mins, codebook, perm, bias, n, k, group_size).float()
    gate, up = reference.split_gate_up(fused)
    sig = torch.sigmoid(gate)
    grad32 = grad.float()
    grad_fused = reference.join_gate_up(grad32 * up * sig * (1 + gate * (1 - sig)), grad32 * gate * sig)
    return _matmul_backward(ctx, grad_fused.to(grad.dtype))


swiglu_matmul_op.register_autograd(_swiglu_matmul_backward, setup_context=_swiglu_matmul_setup_context)


def matmul(x: torch.Tensor, qweight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    if not isinstance(qweight, QuantizedWeight):
        raise TypeError(f"qweight must be a QuantizedWeight (from quantize, from_gptq, ...), got {type(qweight).__name__}")
    check_activation(x, qweight.shape, qweight.device, bias)
    n, k = qweight.shape
    return matmul_op(x, qweight.qweight, qweight.scales, qweight.zeros, qweight.mins, qweight.codebook, qweight.perm,
                     bias, n, k, qweight.group_size)


def swiglu_matmul(x: torch.Tensor, qweight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    if not isinstance(qweight, QuantizedWeight):
        raise TypeError(f"qweight must be a QuantizedWeight (fusion.interleave_gate_up), got {type(qweight).__name__}")
    check_activation(x, qweight.shape, qweight.device, bias)
    n, k = qweight.shape
    check_swiglu_rows(n)
    return swiglu_matmul_op(x, qweight.qweight, qweight.scales, qweight.zeros, qweight.mins, qweight.codebook,
                            qweight.perm, bias, n, k, qweight.group_size)


def dequantize(qweight: QuantizedWeight, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    if not isinstance(qweight, QuantizedWeight):
        raise TypeError(f"qweight must be a QuantizedWeight, got {type(qweight).__name__}")
    dtype = qweight.dtype if dtype is None else dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    n, k = qweight.shape
    return dequantize_op(qweight.qweight, qweight.scales, qweight.zeros, qweight.mins, qweight.codebook, qweight.perm,
                         n, k, qweight.group_size, dtype)
