"""transformers integration: the experts forward for its `ExpertsInterface`, and a layer for `kernelize`.

transformers 5.x MoE models keep their routed experts in one `*Experts` module with `gate_up_proj`
[E, 2I, H] (gate rows, then up rows), `down_proj` [E, H, I] and a forward
`(hidden_states, top_k_index, top_k_weights)`. Either register the forward:

    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register("moe_dispatch", kernel.experts_forward)
    model.set_experts_implementation("moe_dispatch")

or map the `MoEExperts` layer onto the experts class with `kernels.kernelize`.

Expert parallelism through transformers (`from_pretrained(..., distributed_config=DistributedConfig(
ep_size=...))`): the module holds this rank's shard (`num_experts` = E/W, `_is_expert_parallel`) and
transformers moves the tokens. Its default plan (`ep_dispatch_experts`) all-to-alls the tokens and calls
this forward on the received ones with local ids; the router plan (`ep_router` + `moe_tp_experts`) calls it
on every token with local ids and the sentinel id E/W for experts on other ranks (weights zeroed there),
then all-reduces. Either way this forward is the local computation; sentinel slots select nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from .ops import check_quantized_pair, fused_experts, fused_experts_4bit, require_tensors
from .quantized import QuantizedExperts


# transformers' SiLU modules (ACT2FN["silu"] and ACT2FN["swish"]), named so that this package needs no
# transformers import; exact types, since a subclass may compute something else.
_SILU_TYPES = {("torch.nn.modules.activation", "SiLU"), ("transformers.activations", "SiLUActivation")}


def _unsupported(module: nn.Module) -> str | None:
    """Why the fused kernel would not compute exactly what `module`'s eager forward computes, or None."""
    cls = type(module)
    if (getattr(module, "has_bias", False) or getattr(module, "is_transposed", False)
            or not getattr(module, "has_gate", True) or not getattr(module, "is_concatenated", True)):
        return "it needs concatenated gate/up weights [E, 2I, H] and down weights [E, H, I] without bias"
    if getattr(module, "has_post_expert_norm", False):
        return "it has a norm after each expert (has_post_expert_norm)"
    gate = getattr(cls, "_apply_gate", None)
    if gate is not None and (gate.__module__, gate.__name__) != ("transformers.integrations.moe", "_default_apply_gate"):
        return f"it computes its own gate ({cls.__qualname__}._apply_gate), not SiLU(gate) * up"
    act = getattr(module, "act_fn", None)
    if act is not torch.nn.functional.silu and (type(act).__module__, type(act).__name__) not in _SILU_TYPES:
        return f"its activation is {type(act).__name__}, and the kernel computes SiLU(gate) * up"
    kinds = set()
    for name in ("gate_up_proj", "down_proj"):
        reason = _unsupported_weight(module, name)
        if reason is not None:
            return reason
        kinds.add(isinstance(getattr(module, name), QuantizedExperts))
    if len(kinds) > 1:
        return "one of gate_up_proj / down_proj is a QuantizedExperts and the other is not (quantize both)"
    return None


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Tensors other quantization schemes keep next to (or instead of) an experts weight: transformers' MXFP4
# (gpt-oss: *_blocks, *_scales), FP8 (*_scale_inv, *_scale), GPTQ / AWQ-style packs (*_qweight, *_qzeros).
_FOREIGN_SUFFIXES = ("_blocks", "_scales", "_scale", "_scale_inv", "_weight_scale", "_qweight", "_qzeros",
                     "_zeros", "_absmax", "_quant_state")


def _unsupported_weight(module: nn.Module, name: str) -> str | None:
    """Why the experts weight `name` is not something this kernel takes (a float tensor or moe-dispatch's
    QuantizedExperts), or None: weights quantized by other schemes are refused, not misread."""
    weight = getattr(module, name, None)
    foreign = [name + suffix for suffix in _FOREIGN_SUFFIXES if getattr(module, name + suffix, None) is not None]
    if isinstance(weight, QuantizedExperts):
        return None
    if foreign or (weight is not None and not isinstance(weight, torch.Tensor)) or (
            isinstance(weight, torch.Tensor) and (weight.dtype not in _FLOAT_DTYPES
                                                  or getattr(weight, "quant_state", None) is not None)):
        what = (f"{', '.join(foreign)} next to it" if foreign else type(weight).__name__ if not
                isinstance(weight, torch.Tensor) else f"dtype {weight.dtype}")
        return (f"its {name} is quantized by a scheme this kernel does not read ({what}); it takes float experts "
                f"or its own 4-bit QuantizedExperts (moe_dispatch.quantize_experts_module(module) quantizes float "
                f"experts; moe_dispatch.load_quantized_experts(model, folder) reads a GPTQ, AWQ or compressed-tensors "
                f"checkpoint's experts)")
    if weight is None:
        return f"it has no {name} tensor"
    return None


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of a transformers `*Experts` module (its own attributes and layout flags).

    Refuses (ValueError) a module whose eager forward differs from SiLU(gate) * up experts: its own gate,
    another activation, bias, a post-expert norm, other layouts, and experts quantized by other schemes
    (integer / FP8 dtypes, bitsandbytes' quant_state, MXFP4 blocks, GPTQ-style packs). 4-bit experts in this
    package's format (`QuantizedExperts` as gate_up_proj and down_proj, e.g. by `quantize_experts_module`) run
    in the 4-bit kernels. A module sharded by transformers' expert
    parallelism (`_is_expert_parallel`) holds its rank's experts; id `num_experts` (transformers' sentinel
    for an expert on another rank) selects nothing, and DTensor parameters are read as their local shard.
    """
    require_tensors(hidden_states=hidden_states, top_k_index=top_k_index, top_k_weights=top_k_weights)
    reason = _unsupported(self)
    if reason is not None:
        raise ValueError(f"moe-dispatch cannot run {type(self).__name__}: {reason}; use transformers' own "
                         f"experts implementation (e.g. set_experts_implementation('grouped_mm')) for this model")
    sharded = bool(getattr(self, "_is_expert_parallel", False))
    if isinstance(self.gate_up_proj, QuantizedExperts):  # 4-bit experts (quantize_experts_module)
        gate_up, down = self.gate_up_proj, self.down_proj
        intermediate = check_quantized_pair(hidden_states, gate_up, down)
        return fused_experts_4bit(hidden_states, *gate_up.flat(), *down.flat(), intermediate, top_k_weights,
                                  top_k_index, "silu", sharded)
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    return fused_experts(hidden_states, gate_up, down, top_k_weights, top_k_index, "silu", sharded)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local shard (transformers usually swaps those in around the forward)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class MoEExperts(nn.Module):
    """Replaces the forward of transformers' `*Experts` modules (Mixtral, Qwen3-MoE, DeepSeek-V3, ...)."""

    can_torch_compile = True
    has_backward = False

    forward = experts_forward
