"""torch.library registration of the MoE ops: input checks, Triton / PyTorch dispatch, fake kernels.

Dispatch: the Triton path when triton is importable and the tensor is not on the CPU, or when
TRITON_INTERPRET=1 (read at call time); otherwise the PyTorch path in `reference.py`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from . import reference
from ._ops import add_op_namespace_prefix
from .quantized import QuantizedExperts, from_flat

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    from . import triton_kernels

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)
SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu",)


def use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1")


# ----------------------------------------------------------------------------------------------------
# Input checks (shapes, dtypes, devices: no device data is read, so they also run on fake tensors)
# ----------------------------------------------------------------------------------------------------


def check_tensor(name: str, t, dims: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have a dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")


def require_tensors(**named) -> None:
    """TypeError naming the argument, before the dispatcher rejects a non-tensor with a generic error."""
    for name, value in named.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def check_types(**named: tuple) -> None:
    """`name=(value, type or types)`: TypeError naming the argument for a value of another type (bool is
    not taken for a number)."""
    for name, (value, types) in named.items():
        types = types if isinstance(types, tuple) else (types,)
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise TypeError(f"{name} must be {' or '.join(t.__name__ for t in types)}, got {type(value).__name__}")


def check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_same_device(**tensors: torch.Tensor | None) -> None:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def _check_routing(num_experts: int, top_k: int, scoring: str, correction_bias: torch.Tensor | None,
                   num_groups: int | None, topk_groups: int | None, scaling_factor: float) -> None:
    check_int("top_k", top_k, 1)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds the number of experts ({num_experts})")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, 1, FLOAT_DTYPES)
        if correction_bias.shape[0] != num_experts:
            raise ValueError(f"correction_bias has {correction_bias.shape[0]} entries for {num_experts} experts")
    if (num_groups is None) != (topk_groups is None):
        raise ValueError("num_groups and topk_groups must be given together")
    if num_groups is not None:
        check_int("num_groups", num_groups, 1)
        check_int("topk_groups", topk_groups, 1)
        if num_experts % num_groups or (num_groups > 1 and num_experts // num_groups < 2):
            raise ValueError(f"num_groups={num_groups} must divide the {num_experts} experts into groups of >= 2")
        if topk_groups > num_groups:
            raise ValueError(f"topk_groups={topk_groups} exceeds num_groups={num_groups}")
        if top_k > topk_groups * (num_experts // num_groups):
            raise ValueError(f"top_k={top_k} exceeds the experts in the {topk_groups} kept groups")


def _check_weights(hidden_states: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
    """Sizes come from hidden_states (H) and w_gate_up (E, 2I); a mismatch names the tensor that disagrees."""
    check_tensor("hidden_states", hidden_states, 2, FLOAT_DTYPES)
    check_tensor("w_gate_up", w_gate_up, 3, (hidden_states.dtype,))
    check_tensor("w_down", w_down, 3, (hidden_states.dtype,))
    _check_same_device(hidden_states=hidden_states, w_gate_up=w_gate_up, w_down=w_down)
    hidden = hidden_states.shape[1]
    experts, two_i = w_gate_up.shape[0], w_gate_up.shape[1]
    if w_gate_up.shape[2] != hidden or two_i % 2:
        raise ValueError(f"w_gate_up must be [E, 2I, H] with H={hidden} (hidden_states "
                         f"{tuple(hidden_states.shape)}) and an even 2I, got {tuple(w_gate_up.shape)}")
    if w_down.shape != (experts, hidden, two_i // 2):
        raise ValueError(f"w_down must be [E, H, I] = {[experts, hidden, two_i // 2]} to match hidden_states "
                         f"{tuple(hidden_states.shape)} and w_gate_up {tuple(w_gate_up.shape)}, got {tuple(w_down.shape)}")


def _check_experts(hidden_states: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                   allow_sentinel: bool = False) -> None:
    _check_weights(hidden_states, w_gate_up, w_down)
    check_tensor("topk_weights", topk_weights, 2, FLOAT_DTYPES)
    check_tensor("topk_ids", topk_ids, 2, ID_DTYPES)
    _check_same_device(hidden_states=hidden_states, topk_weights=topk_weights, topk_ids=topk_ids)
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [T, k] with T={hidden_states.shape[0]}")
    # With sentinels the experts are one rank's shard: a token may name more experts than the shard holds.
    if topk_ids.shape[1] > w_down.shape[0] and not allow_sentinel:
        raise ValueError(f"top_k={topk_ids.shape[1]} exceeds the number of experts ({w_down.shape[0]})")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _check_id_values(topk_ids: torch.Tensor, num_experts: int, allow_sentinel: bool = False) -> None:
    """Range check, only where it needs no device sync (CPU tensors); on GPUs such ids select nothing.
    `allow_sentinel`: id E is expected (an expert-parallel slot whose expert is on another rank)."""
    if topk_ids.device.type == "cpu" and topk_ids.numel():
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= num_experts + int(allow_sentinel):
            allowed = f"[0, {num_experts}]" if allow_sentinel else f"[0, {num_experts})"
            raise ValueError(f"topk_ids must lie in {allowed}, got values in [{low}, {high}]")


def _check_moe(hidden_states, router_weight, w_gate_up, w_down, shared_gate_up, shared_down) -> None:
    _check_weights(hidden_states, w_gate_up, w_down)
    check_tensor("router_weight", router_weight, 2, (hidden_states.dtype, torch.float32))
    if router_weight.shape[1] != hidden_states.shape[1]:
        raise ValueError(f"router_weight must be [E, H] with H={hidden_states.shape[1]}, got "
                         f"{tuple(router_weight.shape)}")
    if router_weight.shape[0] != w_gate_up.shape[0]:
        raise ValueError(f"router_weight has {router_weight.shape[0]} experts, w_gate_up {w_gate_up.shape[0]}")
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("shared_gate_up and shared_down must be given together")
    if shared_gate_up is not None:
        check_tensor("shared_gate_up", shared_gate_up, 2, (hidden_states.dtype,))
        check_tensor("shared_down", shared_down, 2, (hidden_states.dtype,))
        shared_i = shared_down.shape[1]
        if shared_gate_up.shape != (2 * shared_i, hidden_states.shape[1]) or shared_down.shape[0] != hidden_states.shape[1]:
            raise ValueError(f"shared_gate_up must be [2I, H] and shared_down [H, I], got "
                             f"{tuple(shared_gate_up.shape)} and {tuple(shared_down.shape)}")
    _check_same_device(hidden_states=hidden_states, router_weight=router_weight, w_gate_up=w_gate_up,
                       shared_gate_up=shared_gate_up, shared_down=shared_down)


def _quantized_experts(name: str, flat: tuple, shape: tuple[int, int], hidden_states: torch.Tensor) -> QuantizedExperts:
    """A QuantizedExperts of per-expert `shape` rebuilt from an op's arguments; errors name the argument."""
    qweight, scales, zeros, mins, codebook, group_size = flat
    require_tensors(**{f"{name}.{field}": t for field, t in zip(("qweight", "scales", "zeros", "mins", "codebook"),
                                                                  flat[:5])})
    check_int(f"{name}.group_size", group_size, -1)
    try:
        qe = from_flat(qweight, scales, zeros, mins, codebook, group_size, shape, hidden_states.dtype)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name}: {error}") from None
    if qe.device != hidden_states.device:
        raise ValueError(f"{name} is on {qe.device} but hidden_states is on {hidden_states.device}")
    return qe


def _check_quantized_weights(hidden_states: torch.Tensor, gate_up: tuple, down: tuple,
                             intermediate: int) -> tuple[QuantizedExperts, QuantizedExperts]:
    """4-bit experts of H = hidden_states' width and I = `intermediate`: w_gate_up (2I, H), w_down (H, I) per
    expert, the same number of experts."""
    check_tensor("hidden_states", hidden_states, 2, FLOAT_DTYPES)
    check_int("intermediate", intermediate, 1)
    hidden = hidden_states.shape[1]
    w_gate_up = _quantized_experts("w_gate_up", gate_up, (2 * intermediate, hidden), hidden_states)
    w_down = _quantized_experts("w_down", down, (hidden, intermediate), hidden_states)
    if w_down.num_experts != w_gate_up.num_experts:
        raise ValueError(f"w_down holds {w_down.num_experts} experts, w_gate_up {w_gate_up.num_experts}")
    return w_gate_up, w_down


def check_quantized_pair(hidden_states, w_gate_up, w_down) -> int:
    """The intermediate size I of a (w_gate_up, w_down) pair of QuantizedExperts for hidden_states [T, H];
    TypeError / ValueError naming the argument (both must be 4-bit, of matching shapes)."""
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, QuantizedExperts):
            raise TypeError(f"{name} must be a QuantizedExperts when the other expert weight is one (4-bit "
                            f"experts: both quantized, e.g. by quantize_experts), got {type(w).__name__}")
    check_tensor("hidden_states", hidden_states, 2, FLOAT_DTYPES)
    two_i, hidden = w_gate_up.shape
    if hidden != hidden_states.shape[1] or two_i % 2:
        raise ValueError(f"w_gate_up must hold experts of shape (2I, H) with H={hidden_states.shape[1]} "
                         f"(hidden_states {tuple(hidden_states.shape)}) and an even 2I, got {w_gate_up.shape}")
    if w_down.shape != (hidden, two_i // 2):
        raise ValueError(f"w_down must hold experts of shape (H, I) = {(hidden, two_i // 2)} to match w_gate_up "
                         f"{w_gate_up.shape}, got {w_down.shape}")
    return two_i // 2


def _check_quantized_experts(hidden_states, gate_up, down, intermediate, topk_weights, topk_ids, activation,
                             allow_sentinel=False) -> tuple[QuantizedExperts, QuantizedExperts]:
    w_gate_up, w_down = _check_quantized_weights(hidden_states, gate_up, down, intermediate)
    _check_routing_inputs(hidden_states, w_down.num_experts, topk_weights, topk_ids, activation, allow_sentinel)
    return w_gate_up, w_down


def _check_routing_inputs(hidden_states, num_experts, topk_weights, topk_ids, activation, allow_sentinel) -> None:
    check_tensor("topk_weights", topk_weights, 2, FLOAT_DTYPES)
    check_tensor("topk_ids", topk_ids, 2, ID_DTYPES)
    _check_same_device(hidden_states=hidden_states, topk_weights=topk_weights, topk_ids=topk_ids)
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [T, k] with T={hidden_states.shape[0]}")
    if topk_ids.shape[1] > num_experts and not allow_sentinel:
        raise ValueError(f"top_k={topk_ids.shape[1]} exceeds the number of experts ({num_experts})")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _check_shared(hidden_states, shared_gate_up, shared_down) -> None:
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("shared_gate_up and shared_down must be given together")
    if shared_gate_up is not None:
        check_tensor("shared_gate_up", shared_gate_up, 2, (hidden_states.dtype,))
        check_tensor("shared_down", shared_down, 2, (hidden_states.dtype,))
        shared_i = shared_down.shape[1]
        if shared_gate_up.shape != (2 * shared_i, hidden_states.shape[1]) or shared_down.shape[0] != hidden_states.shape[1]:
            raise ValueError(f"shared_gate_up must be [2I, H] and shared_down [H, I], got "
                             f"{tuple(shared_gate_up.shape)} and {tuple(shared_down.shape)}")
        _check_same_device(hidden_states=hidden_states, shared_gate_up=shared_gate_up, shared_down=shared_down)


def _check_quantized_moe(hidden_states, router_weight, gate_up, down, intermediate, shared_gate_up,
                         shared_down) -> tuple[QuantizedExperts, QuantizedExperts]:
    w_gate_up, w_down = _check_quantized_weights(hidden_states, gate_up, down, intermediate)
    check_tensor("router_weight", router_weight, 2, (hidden_states.dtype, torch.float32))
    if router_weight.shape[1] != hidden_states.shape[1]:
        raise ValueError(f"router_weight must be [E, H] with H={hidden_states.shape[1]}, got "
                         f"{tuple(router_weight.shape)}")
    if router_weight.shape[0] != w_gate_up.num_experts:
        raise ValueError(f"router_weight has {router_weight.shape[0]} experts, w_gate_up {w_gate_up.num_experts}")
    _check_same_device(hidden_states=hidden_states, router_weight=router_weight)
    _check_shared(hidden_states, shared_gate_up, shared_down)
    return w_gate_up, w_down


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels index the last dimension with stride 1."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op(add_op_namespace_prefix("route"), mutates_args=())
def route(router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
          correction_bias: Optional[torch.Tensor], num_groups: Optional[int], topk_groups: Optional[int],
          scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor("router_logits", router_logits, 2, FLOAT_DTYPES)
    _check_routing(router_logits.shape[1], top_k, scoring, correction_bias, num_groups, topk_groups, scaling_factor)
    _check_same_device(router_logits=router_logits, correction_bias=correction_bias)
    args = (top_k, scoring == "sigmoid", renormalize, _rows(correction_bias), num_groups or 1, topk_groups or 1,
            scaling_factor)
    if use_triton(router_logits):
        return triton_kernels.route(_rows(router_logits), *args)
    return reference.route(router_logits, *args)


@route.register_fake
def _(router_logits, top_k, scoring, renormalize, correction_bias, num_groups, topk_groups, scaling_factor):
    check_tensor("router_logits", router_logits, 2, FLOAT_DTYPES)
    _check_routing(router_logits.shape[1], top_k, scoring, correction_bias, num_groups, topk_groups, scaling_factor)
    tokens = router_logits.shape[0]
    return (router_logits.new_empty(tokens, top_k, dtype=torch.float32),
            router_logits.new_empty(tokens, top_k, dtype=torch.int32))


@torch.library.custom_op(add_op_namespace_prefix("fused_experts"), mutates_args=())
def fused_experts(hidden_states: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                  allow_sentinel: bool = False) -> torch.Tensor:
    """`allow_sentinel`: the weights are one rank's expert shard [E_local, ...] and id E_local (transformers'
    expert-parallel sentinel, also parallel.py's) marks a slot whose expert is elsewhere; it selects nothing.
    Without it, an id outside [0, E) is an error on CPU tensors (on GPUs it selects nothing, unchecked)."""
    _check_experts(hidden_states, w_gate_up, w_down, topk_weights, topk_ids, activation, allow_sentinel)
    _check_id_values(topk_ids, w_down.shape[0], allow_sentinel)
    if use_triton(hidden_states):
        out = torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
        return triton_kernels.experts(_rows(hidden_states), _rows(w_gate_up), _rows(w_down),
                                      topk_weights.contiguous(), topk_ids.contiguous(), out)
    return reference.fused_experts(hidden_states, w_gate_up, w_down, topk_weights, topk_ids)


@fused_experts.register_fake
def _(hidden_states, w_gate_up, w_down, topk_weights, topk_ids, activation, allow_sentinel=False):
    _check_experts(hidden_states, w_gate_up, w_down, topk_weights, topk_ids, activation, allow_sentinel)
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


@torch.library.custom_op(add_op_namespace_prefix("moe_forward"), mutates_args=())
def moe_forward(hidden_states: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
                correction_bias: Optional[torch.Tensor], num_groups: Optional[int], topk_groups: Optional[int],
                scaling_factor: float, shared_gate_up: Optional[torch.Tensor],
                shared_down: Optional[torch.Tensor]) -> torch.Tensor:
    _check_moe(hidden_states, router_weight, w_gate_up, w_down, shared_gate_up, shared_down)
    _check_routing(w_gate_up.shape[0], top_k, scoring, correction_bias, num_groups, topk_groups, scaling_factor)
    routing = (top_k, scoring == "sigmoid", renormalize, _rows(correction_bias), num_groups or 1, topk_groups or 1,
               scaling_factor)
    if use_triton(hidden_states):
        # a shared expert of the routed intermediate size rides along as an extra expert
        fuse_shared = shared_down is not None and shared_down.shape[1] == w_down.shape[2]
        out = torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
        triton_kernels.moe_forward(_rows(hidden_states), _rows(router_weight), _rows(w_gate_up), _rows(w_down),
                                   *routing, _rows(shared_gate_up) if fuse_shared else None,
                                   _rows(shared_down) if fuse_shared else None, out)
        if shared_down is not None and not fuse_shared:
            out += reference.dense_expert(hidden_states, shared_gate_up, shared_down)
        return out
    weights, ids = reference.route(reference.router_logits(hidden_states, router_weight), *routing)
    out = reference.fused_experts(hidden_states, w_gate_up, w_down, weights, ids)
    if shared_down is not None:
        out = out + reference.dense_expert(hidden_states, shared_gate_up, shared_down)
    return out


@moe_forward.register_fake
def _(hidden_states, router_weight, w_gate_up, w_down, top_k, scoring, renormalize, correction_bias, num_groups,
      topk_groups, scaling_factor, shared_gate_up, shared_down):
    _check_moe(hidden_states, router_weight, w_gate_up, w_down, shared_gate_up, shared_down)
    _check_routing(w_gate_up.shape[0], top_k, scoring, correction_bias, num_groups, topk_groups, scaling_factor)
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


# 4-bit experts: the same ops with each expert weight passed as its QuantizedExperts fields
# (qweight, scales, zeros, mins, codebook, group_size) and the intermediate size I.


@torch.library.custom_op(add_op_namespace_prefix("fused_experts_4bit"), mutates_args=())
def fused_experts_4bit(hidden_states: torch.Tensor, gu_qweight: torch.Tensor, gu_scales: torch.Tensor,
                       gu_zeros: Optional[torch.Tensor], gu_mins: Optional[torch.Tensor],
                       gu_codebook: Optional[torch.Tensor], gu_group_size: int, dn_qweight: torch.Tensor,
                       dn_scales: torch.Tensor, dn_zeros: Optional[torch.Tensor], dn_mins: Optional[torch.Tensor],
                       dn_codebook: Optional[torch.Tensor], dn_group_size: int, intermediate: int,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                       allow_sentinel: bool = False) -> torch.Tensor:
    """`fused_experts` with 4-bit experts (`QuantizedExperts` of shapes (2I, H) and (H, I) per expert)."""
    w_gate_up, w_down = _check_quantized_experts(
        hidden_states, (gu_qweight, gu_scales, gu_zeros, gu_mins, gu_codebook, gu_group_size),
        (dn_qweight, dn_scales, dn_zeros, dn_mins, dn_codebook, dn_group_size), intermediate, topk_weights, topk_ids,
        activation, allow_sentinel)
    _check_id_values(topk_ids, w_down.num_experts, allow_sentinel)
    if use_triton(hidden_states):
        out = torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
        return triton_kernels.experts(_rows(hidden_states), w_gate_up, w_down, topk_weights.contiguous(),
                                      topk_ids.contiguous(), out)
    return reference.fused_experts_quantized(hidden_states, w_gate_up, w_down, topk_weights, topk_ids)


@fused_experts_4bit.register_fake
def _(hidden_states, gu_qweight, gu_scales, gu_zeros, gu_mins, gu_codebook, gu_group_size, dn_qweight, dn_scales,
      dn_zeros, dn_mins, dn_codebook, dn_group_size, intermediate, topk_weights, topk_ids, activation,
      allow_sentinel=False):
    _check_quantized_experts(hidden_states, (gu_qweight, gu_scales, gu_zeros, gu_mins, gu_codebook, gu_group_size),
                             (dn_qweight, dn_scales, dn_zeros, dn_mins, dn_codebook, dn_group_size), intermediate,
                             topk_weights, topk_ids, activation, allow_sentinel)
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


@torch.library.custom_op(add_op_namespace_prefix("moe_forward_4bit"), mutates_args=())
def moe_forward_4bit(hidden_states: torch.Tensor, router_weight: torch.Tensor, gu_qweight: torch.Tensor,
                     gu_scales: torch.Tensor, gu_zeros: Optional[torch.Tensor], gu_mins: Optional[torch.Tensor],
                     gu_codebook: Optional[torch.Tensor], gu_group_size: int, dn_qweight: torch.Tensor,
                     dn_scales: torch.Tensor, dn_zeros: Optional[torch.Tensor], dn_mins: Optional[torch.Tensor],
                     dn_codebook: Optional[torch.Tensor], dn_group_size: int, intermediate: int, top_k: int,
                     scoring: str, renormalize: bool, correction_bias: Optional[torch.Tensor],
                     num_groups: Optional[int], topk_groups: Optional[int], scaling_factor: float,
                     shared_gate_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor]) -> torch.Tensor:
    """`moe_forward` with 4-bit routed experts; a shared expert stays a dense [2I', H], [H, I'] pair and is
    added after the routed experts (it does not ride along in the 4-bit kernels)."""
    w_gate_up, w_down = _check_quantized_moe(
        hidden_states, router_weight, (gu_qweight, gu_scales, gu_zeros, gu_mins, gu_codebook, gu_group_size),
        (dn_qweight, dn_scales, dn_zeros, dn_mins, dn_codebook, dn_group_size), intermediate, shared_gate_up,
        shared_down)
    _check_routing(w_gate_up.num_experts, top_k, scoring, correction_bias, num_groups, topk_groups, scaling_factor)
    routing = (top_k, scoring == "sigmoid", renormalize, _rows(correction_bias), num_groups or 1, topk_groups or 1,
               scaling_factor)
    if use_triton(hidden_states):
        out = torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
        triton_kernels.moe_forward(_rows(hidden_states), _rows(router_weight), w_gate_up, w_down, *routing, None,
                                   None, out)
        if shared_down is not None:
            out += reference.dense_expert(hidden_states, shared_gate_up, shared_down)
        return out
    weights, ids = reference.route(reference.router_logits(hidden_states, router_weight), *routing)
    out = reference.fused_experts_quantized(hidden_states, w_gate_up, w_down, weights, ids)
    if shared_down is not None:
        out = out + reference.dense_expert(hidden_states, shared_gate_up, shared_down)
    return out


@moe_forward_4bit.register_fake
def _(hidden_states, router_weight, gu_qweight, gu_scales, gu_zeros, gu_mins, gu_codebook, gu_group_size, dn_qweight,
      dn_scales, dn_zeros, dn_mins, dn_codebook, dn_group_size, intermediate, top_k, scoring, renormalize,
      correction_bias, num_groups, topk_groups, scaling_factor, shared_gate_up, shared_down):
    w_gate_up, _ = _check_quantized_moe(
        hidden_states, router_weight, (gu_qweight, gu_scales, gu_zeros, gu_mins, gu_codebook, gu_group_size),
        (dn_qweight, dn_scales, dn_zeros, dn_mins, dn_codebook, dn_group_size), intermediate, shared_gate_up,
        shared_down)
    _check_routing(w_gate_up.num_experts, top_k, scoring, correction_bias, num_groups, topk_groups, scaling_factor)
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
