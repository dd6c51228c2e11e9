"""Modules for models: `W4A16Linear` (an ``nn.Linear`` replacement holding a 4-bit weight) and
`quantize_model`, which swaps a model's ``nn.Linear`` layers in place.

These are ordinary modules built by conversion, not `kernels.kernelize` layers (a kernelize layer may
not hold state of its own, and a 4-bit weight is state).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from . import ops
from .formats import QuantizedWeight, quantize

_FIELDS = ("qweight", "scales", "zeros", "codebook", "perm")


class W4A16Linear(nn.Module):
    """``y = x @ W.T + b`` with W stored as a `QuantizedWeight`; its tensors are buffers (state_dict, .to)."""

    def __init__(self, qweight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        if not isinstance(qweight, QuantizedWeight):
            raise TypeError(f"qweight must be a QuantizedWeight, got {type(qweight).__name__}")
        self.out_features, self.in_features = qweight.shape
        self.group_size = qweight.group_size
        self.fmt = qweight.fmt
        self.weight_dtype = qweight.dtype
        for name in _FIELDS:
            self.register_buffer(name, getattr(qweight, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, *, zero_point: bool = False,
                    fmt: str = "int4") -> "W4A16Linear":
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        qweight = quantize(linear.weight.detach(), group_size=group_size, zero_point=zero_point, fmt=fmt)
        return cls(qweight, linear.bias)

    @property
    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(**{name: getattr(self, name) for name in _FIELDS},
                               shape=(self.out_features, self.in_features), group_size=self.group_size,
                               fmt=self.fmt, dtype=self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        bias = None if self.bias is None else self.bias.to(x.dtype)
        ops.check_activation(x, (n, k), self.qweight.device, bias)
        return ops.matmul_op(x, self.qweight, self.scales, self.zeros, self.codebook, self.perm, bias,
                             n, k, self.group_size)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fmt={self.fmt}, group_size={self.group_size}, zero_point={self.zeros is not None}")


def _skipped(name: str, skip: Iterable[str]) -> bool:
    parts = name.split(".")
    return any(s == name or s in parts or name.endswith("." + s) for s in skip)


def quantize_model(model: nn.Module, group_size: int = 128, skip: Iterable[str] = ("lm_head",), *,
                   zero_point: bool = False, fmt: str = "int4", calibration: Optional[Iterable] = None,
                   act_order: bool = False, damp: float = 0.01) -> nn.Module:
    """Replace every ``nn.Linear`` of `model` whose qualified name does not match `skip` (a name, or a
    component of the dotted name) by a `W4A16Linear`, in place; returns `model`. Round-to-nearest, or with
    `calibration` (model inputs: token-id tensors or dicts of keyword arguments) GPTQ for the linears of the
    decoder layers (`gptq.calibrate_model`, optionally `act_order`, with `damp` added to the Hessian's diagonal as
    a fraction of its mean) and round-to-nearest for the others."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(skip, str):
        skip = (skip,)
    skip = tuple(skip)
    if calibration is not None:
        from .gptq import calibrate_model

        calibrate_model(model, calibration, group_size, skip, zero_point=zero_point, fmt=fmt, act_order=act_order,
                        damp=damp)
    elif act_order:
        raise ValueError("act_order=True needs calibration (GPTQ); round-to-nearest has no column order")
    targets = [(name, module) for name, module in model.named_modules()
               if name and isinstance(module, nn.Linear) and not _skipped(name, skip)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, W4A16Linear.from_linear(module, group_size, zero_point=zero_point, fmt=fmt))
    return model
