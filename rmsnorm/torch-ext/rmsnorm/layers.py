"""Layers for `kernels.kernelize`: forwards that replace the `transformers` modules tagged with
`@use_kernel_forward_from_hub("RMSNorm")` (LlamaRMSNorm and its copies) and
`@use_kernel_forward_from_hub("RMSNormZeroCentered")` (the `1 + weight` norms of Gemma and Qwen3.5).
They read the replaced module's attributes and hold no state of their own."""

from __future__ import annotations

import torch
from torch import nn

from . import ops


class RMSNorm(nn.Module):
    """`LlamaRMSNorm.forward`: reads `self.weight` and `self.variance_epsilon`."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon, 0.0)


class RMSNormZeroCentered(nn.Module):
    """`GemmaRMSNorm.forward` (output = x * rstd * (1 + weight) in fp32, cast to x's dtype): reads
    `self.weight` and `self.eps`."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, 1.0)
