"""Fused Mixture-of-Experts forward: routing, sort by expert, grouped SwiGLU experts and combine."""

from __future__ import annotations

import torch

from . import checkpoints, layers, ops, parallel, quantized
from .checkpoints import load_quantized_experts
from .layers import experts_forward
from .parallel import ExpertParallel
from .quantized import NF4_CODEBOOK, QuantizedExperts, dequantize, quantize_experts, quantize_experts_module

__all__ = ["route", "fused_experts", "moe_forward", "experts_forward", "ExpertParallel", "QuantizedExperts",
           "quantize_experts", "quantize_experts_module", "dequantize", "NF4_CODEBOOK", "load_quantized_experts",
           "layers", "quantized", "checkpoints"]


def _is_quantized(w_gate_up, w_down) -> bool:
    return isinstance(w_gate_up, QuantizedExperts) or isinstance(w_down, QuantizedExperts)


def route(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
          correction_bias: torch.Tensor | None = None, num_groups: int | None = None,
          topk_groups: int | None = None, scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of `router_logits` [T, E] -> (topk_weights float32 [T, k], topk_ids int32 [T, k]).

    scoring="softmax" (Mixtral, Qwen3-MoE): softmax over all experts, top-k, optionally renormalized.
    scoring="sigmoid" (DeepSeek-V3): sigmoid scores; `correction_bias` [E] is added for selection only;
    with `num_groups`, only the `topk_groups` groups with the best top-2 sums compete. Weights are the
    (renormalized) scores times `scaling_factor`. Ids come in descending order of selection score.
    """
    ops.require_tensors(router_logits=router_logits, correction_bias=correction_bias)
    ops.check_int("top_k", top_k, 1)
    ops.check_types(scoring=(scoring, str), renormalize=(renormalize, bool), scaling_factor=(scaling_factor, (float, int)))
    return ops.route(router_logits, top_k, scoring, renormalize, correction_bias, num_groups, topk_groups,
                     scaling_factor)


def fused_experts(hidden_states: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, activation: str = "silu",
                  expert_parallel: ExpertParallel | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(SiLU(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, j] -> [T, H].

    hidden_states [T, H]; w_gate_up [E, 2I, H] (gate rows, then up rows); w_down [E, H, I]; the layout of
    transformers' experts modules. fp16, bf16 or fp32. Either weight may instead be 4-bit: both then are
    `QuantizedExperts` (`quantize_experts(w_gate_up, w_down, ...)`; the w4a16 format per expert: int4 symmetric,
    with zero points or with float minima, or NF4), dequantized in registers inside the same kernels.

    With `expert_parallel` (an `ExpertParallel`), the weights are this rank's shard [E/W, ...] (`ep.shard(w)`),
    topk_ids are global ids in [0, E), and every rank of the group calls with its own tokens: tokens go to
    the ranks that hold their experts by all-to-all and come back combined (see parallel.py).
    """
    ops.require_tensors(hidden_states=hidden_states, topk_weights=topk_weights, topk_ids=topk_ids)
    ops.check_types(activation=(activation, str))
    if _is_quantized(w_gate_up, w_down):
        if expert_parallel is not None:
            raise ValueError("expert_parallel: 4-bit experts (QuantizedExperts) do not run expert-parallel yet; "
                             "pass dense [E/W, ...] shards or leave expert_parallel=None")
        intermediate = ops.check_quantized_pair(hidden_states, w_gate_up, w_down)
        return ops.fused_experts_4bit(hidden_states, *w_gate_up.flat(), *w_down.flat(), intermediate, topk_weights,
                                      topk_ids, activation)
    ops.require_tensors(w_gate_up=w_gate_up, w_down=w_down)
    if expert_parallel is not None:
        return parallel.fused_experts(expert_parallel, hidden_states, w_gate_up, w_down, topk_weights, topk_ids,
                                      activation)
    return ops.fused_experts(hidden_states, w_gate_up, w_down, topk_weights, topk_ids, activation)


def moe_forward(hidden_states: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
                correction_bias: torch.Tensor | None = None, num_groups: int | None = None,
                topk_groups: int | None = None, scaling_factor: float = 1.0,
                shared_gate_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
                expert_parallel: ExpertParallel | None = None) -> torch.Tensor:
    """The whole MoE block on hidden_states [..., H]: router logits (hidden_states @ router_weight^T, in the
    router weight's dtype), `route`, `fused_experts`, plus an optional shared expert applied to every
    token (shared_gate_up [2I', H], shared_down [H, I']). w_gate_up / w_down may be 4-bit `QuantizedExperts`
    (see `fused_experts`); the shared expert then stays dense and is added after the routed experts.

    With `expert_parallel`, router_weight is the full [E, H] (replicated), w_gate_up / w_down this rank's
    shard [E/W, ...], the shared expert replicated; every rank of the group calls with its own tokens."""
    ops.require_tensors(hidden_states=hidden_states, router_weight=router_weight, correction_bias=correction_bias,
                        shared_gate_up=shared_gate_up, shared_down=shared_down)
    ops.check_int("top_k", top_k, 1)
    ops.check_types(scoring=(scoring, str), renormalize=(renormalize, bool), scaling_factor=(scaling_factor, (float, int)))
    flat = hidden_states.reshape(-1, hidden_states.shape[-1]) if hidden_states.dim() != 2 else hidden_states
    if _is_quantized(w_gate_up, w_down):
        if expert_parallel is not None:
            raise ValueError("expert_parallel: 4-bit experts (QuantizedExperts) do not run expert-parallel yet; "
                             "pass dense [E/W, ...] shards or leave expert_parallel=None")
        intermediate = ops.check_quantized_pair(flat, w_gate_up, w_down)
        out = ops.moe_forward_4bit(flat, router_weight, *w_gate_up.flat(), *w_down.flat(), intermediate, top_k,
                                   scoring, renormalize, correction_bias, num_groups, topk_groups, scaling_factor,
                                   shared_gate_up, shared_down)
        return out.view(hidden_states.shape)
    ops.require_tensors(w_gate_up=w_gate_up, w_down=w_down)
    if expert_parallel is not None:
        out = parallel.moe_forward(expert_parallel, flat, router_weight, w_gate_up, w_down, top_k, scoring,
                                   renormalize, correction_bias, num_groups, topk_groups, scaling_factor,
                                   shared_gate_up, shared_down)
        return out.view(hidden_states.shape)
    out = ops.moe_forward(flat, router_weight, w_gate_up, w_down, top_k, scoring, renormalize, correction_bias,
                          num_groups, topk_groups, scaling_factor, shared_gate_up, shared_down)
    return out.view(hidden_states.shape)
