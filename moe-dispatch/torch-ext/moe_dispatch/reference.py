"""The pure-PyTorch path: CPU tensors (the torch-cpu variant) and devices without triton.

Semantics follow transformers' eager MoE code (routers of Mixtral / Qwen3-MoE / DeepSeek-V3 and the
per-expert loop of their `*Experts` modules); arithmetic follows the Triton path so both paths round
at the same places: logits in the router weight's dtype, SiLU(gate) * up rounded once to the
activation dtype, each expert's output times its routing weight (fp32) rounded once, the top-k sum in
fp32. Expert ids outside [0, E) select nothing (transformers' expert-parallel sentinel convention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quantized import QuantizedExperts, dequantize_fp32


def router_logits(hidden_states: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """Logits in the router weight's dtype, as `F.linear` gives them in the models."""
    return F.linear(hidden_states.to(router_weight.dtype), router_weight)


def route(
    logits: torch.Tensor,
    top_k: int,
    sigmoid: bool,
    renormalize: bool,
    correction_bias: torch.Tensor | None,
    num_groups: int,
    topk_groups: int,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, num_groups, experts // num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        choice = grouped.masked_fill(~kept[..., None], float("-inf")).view(tokens, experts)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
    return weights * scaling_factor, ids.to(torch.int32)


def fused_experts(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    return _experts_loop(hidden_states, lambda e: w_gate_up[e].float(), lambda e: w_down[e].float(),
                         w_down.shape[0], w_down.shape[2], topk_weights, topk_ids)


def fused_experts_quantized(hidden_states: torch.Tensor, w_gate_up: QuantizedExperts, w_down: QuantizedExperts,
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """4-bit experts: each picked expert dequantized in fp32 and rounded once to the activation dtype, as the
    kernels round the dequantized operand tiles; the rest as `fused_experts`."""
    dtype = hidden_states.dtype

    def weight(qe: QuantizedExperts):
        return lambda e: dequantize_fp32(qe, slice(e, e + 1))[0].to(dtype).float()

    return _experts_loop(hidden_states, weight(w_gate_up), weight(w_down), w_down.num_experts, w_down.shape[1],
                         topk_weights, topk_ids)


def _experts_loop(hidden_states, gate_up_of, down_of, num_experts: int, intermediate: int, topk_weights,
                  topk_ids) -> torch.Tensor:
    """The per-expert loop over fp32 weights `gate_up_of(e)` [2I, H] and `down_of(e)` [H, I]."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    flat_ids = topk_ids.reshape(-1)
    for expert in range(num_experts):
        pairs = (flat_ids == expert).nonzero().squeeze(1)
        if pairs.numel() == 0:
            continue
        tokens = pairs // topk_ids.shape[1]
        gate_up = hidden_states[tokens].float() @ gate_up_of(expert).T
        act = (F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]).to(hidden_states.dtype)
        down = act.float() @ down_of(expert).T
        weighted = (down * topk_weights.reshape(-1)[pairs, None].float()).to(hidden_states.dtype)
        out.index_add_(0, tokens, weighted.float())
    return out.to(hidden_states.dtype)


def dense_expert(hidden_states: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert applied to every token (a shared expert), rounded like the routed ones."""
    intermediate = w_down.shape[1]
    gate_up = hidden_states.float() @ w_gate_up.float().T
    act = (F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]).to(hidden_states.dtype)
    return (act.float() @ w_down.float().T).to(hidden_states.dtype)
