"""transformers integration: the experts forward for its `ExpertsInterface`, and a layer for `kernelize`.

transformers 5.x MoE models keep their routed experts in one `*Experts` module with `gate_up_proj`
[E, 2I, H] (gate rows, then up rows), `down_proj` [E, H, I] and a forward
`(hidden_states, top_k_index, top_k_weights)`. Either register the forward:

    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register("moe_dispatch", kernel.experts_forward)
    model.set_experts_implementation("moe_dispatch")

or map the `MoEExperts` layer onto the experts class with `kernels.kernelize`.
"""

from __future__ import annotations

import torch
from torch import nn

from .ops import fused_experts


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of a transformers `*Experts` module (its own attributes and layout flags)."""
    if (getattr(self, "has_bias", False) or getattr(self, "is_transposed", False)
            or not getattr(self, "has_gate", True) or not getattr(self, "is_concatenated", True)):
        raise ValueError(f"{type(self).__name__}: moe-dispatch needs concatenated gate/up weights [E, 2I, H] "
                         "and down weights [E, H, I] without bias")
    activation = getattr(getattr(self, "config", None), "hidden_act", "silu")
    return fused_experts(hidden_states, self.gate_up_proj, self.down_proj, top_k_weights, top_k_index, activation)


class MoEExperts(nn.Module):
    """Replaces the forward of transformers' `*Experts` modules (Mixtral, Qwen3-MoE, DeepSeek-V3, ...)."""

    can_torch_compile = True
    has_backward = False

    forward = experts_forward
