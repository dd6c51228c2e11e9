"""The launchers: routing, the experts of a layer (`experts`) and the whole layer (`moe_forward`)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..quantized import PAD_N, QuantizedExperts
from .configs import (CHUNK_TOKENS, DECODE_MAX_TOKENS, DEQUANT_BLOCK_N, DEQUANT_CHUNK_BYTES, DEQUANT_MIN_PAIRS,
                      DEQUANT_OVERLAP, ROUTER_BLOCK_E, ROUTER_GEMV_ELEMENTS, ROUTER_GEMV_MAX_TOKENS, WGMMA_LONG_K_TILES,
                      WGMMA_MIN_PAIRS, WGMMA_PLAN, _for_dtype, _for_weights, _sm_count, default_config, get_config)
from .experts import (_combine_kernel, _dequantize_kernel, _down_decode_kernel, _down_grouped_kernel,
                      _down_stream_kernel, _gate_up_decode_kernel, _gate_up_grouped_kernel, _gate_up_stream_kernel,
                      _gather_rows_kernel)
from .gemv import _down_gemv_kernel, _down_h2_kernel, _gate_up_gemv_kernel, _gate_up_h2_kernel
from .routing import _align_kernel, _histogram_kernel, _route_kernel, _router_gemv_kernel
from .tiles import SCALE_ON_ACC

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands: three tf32 passes give fp32 accuracy on tensor cores; 16-bit operands ignore this
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _interpreting() -> bool:
    """Whether the kernels run in the Triton interpreter (read at call time, as Triton does)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _upcast_dots(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and _interpreting()


def _device_guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _num_bins(num_experts: int) -> int:
    return triton.next_power_of_2(num_experts)


def route(logits: torch.Tensor, top_k: int, sigmoid: bool, renormalize: bool, correction_bias: torch.Tensor | None,
          num_groups: int, topk_groups: int, scaling_factor: float, *, hidden_states: torch.Tensor | None = None,
          router_weight: torch.Tensor | None = None, shared_slot: bool = False,
          hist: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of `logits` [T, E], or of hidden_states @ router_weight^T when those are given.

    With `shared_slot` an extra last slot names expert E with weight 1; with `hist` each CHUNK_TOKENS-token
    chunk's expert histogram is written to it (the fused path's input to the sort). Router logits of up to
    ROUTER_GEMV_MAX_TOKENS tokens come from `_router_gemv_kernel` (the router's rows spread over the GPU); the
    routing kernel's own programs compute them at more tokens.
    """
    fused = hidden_states is not None
    T, E = (hidden_states.shape[0], router_weight.shape[0]) if fused else logits.shape
    out_k = top_k + int(shared_slot)
    device = (hidden_states if fused else logits).device
    weights = torch.empty(T, out_k, dtype=torch.float32, device=device)
    ids = torch.empty(T, out_k, dtype=torch.int32, device=device)
    if T == 0:
        return weights, ids
    # the histogram is per CHUNK_TOKENS chunk; at decode one token per program (its warp reductions' latency is the
    # kernel's time, so tokens side by side cost one token's time); otherwise up to 16 tokens per program
    block_t = (CHUNK_TOKENS if hist is not None else 1 if T <= DECODE_MAX_TOKENS
               else min(16, triton.next_power_of_2(T)))
    block_e = max(16, triton.next_power_of_2(E))
    pdl = False
    dummy = weights
    with _device_guard(weights):
        if fused and hist is None and T <= ROUTER_GEMV_MAX_TOKENS:
            logits = torch.empty(T, E, dtype=router_weight.dtype, device=device)
            pdl = _pdl_device(device)
            gemv_t = triton.next_power_of_2(T)  # every token in each program of router rows
            block_h = min(ROUTER_GEMV_ELEMENTS // (gemv_t * ROUTER_BLOCK_E),
                          triton.next_power_of_2(hidden_states.shape[1]))
            _router_gemv_kernel[(triton.cdiv(E, ROUTER_BLOCK_E),)](
                hidden_states, router_weight, logits, T, E, hidden_states.shape[1], hidden_states.stride(0),
                router_weight.stride(0), BLOCK_T=gemv_t, BLOCK_E=ROUTER_BLOCK_E, BLOCK_H=block_h, PDL=pdl,
                launch_pdl=pdl, num_warps=4,
            )
            fused = False  # the routing kernel reads these logits as it reads cuBLAS's
        _route_kernel[(triton.cdiv(T, block_t),)](
            dummy if fused else logits, hidden_states if fused else dummy, router_weight if fused else dummy,
            correction_bias if correction_bias is not None else dummy, weights, ids,
            hist if hist is not None else ids,
            T, E, hidden_states.shape[1] if fused else 0, 0 if fused else logits.stride(0),
            hidden_states.stride(0) if fused else 0, router_weight.stride(0) if fused else 0, scaling_factor,
            TOP_K=top_k, OUT_K=out_k, K_POW2=triton.next_power_of_2(out_k),
            SIGMOID=sigmoid, RENORMALIZE=renormalize, HAS_BIAS=correction_bias is not None,
            NUM_GROUPS=num_groups, GROUPS_POW2=triton.next_power_of_2(max(num_groups, 1)), TOPK_GROUPS=topk_groups,
            FUSED_LOGITS=fused, WRITE_HIST=hist is not None,
            NUM_BINS=_num_bins(E + int(shared_slot)),
            PRECISION=_precision(router_weight.dtype if fused else torch.float16),
            UPCAST=fused and _upcast_dots(router_weight.dtype), PDL=pdl, launch_pdl=pdl,
            BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=64 if block_e <= 128 else 32,
            num_warps=max(1, min(16, block_t * block_e // 512)),
        )
    return weights, ids


def _words(w) -> torch.Tensor:
    """The tensor a kernel's w_ptr points at: a dense weight, or a QuantizedExperts' packed words."""
    return w.qweight if isinstance(w, QuantizedExperts) else w


def _weight_args(w) -> tuple[tuple, tuple, dict]:
    """(s, z, m, cb pointers), (stride_we, stride_wn, stride_se, stride_sg) and the format constexprs of an
    expert weight; dense weights pass themselves for the unused pointers (QUANT=False prunes every use)."""
    if not isinstance(w, QuantizedExperts):
        return (w, w, w, w), (w.stride(0), w.stride(1), 0, 0), dict(QUANT=False, NF4=False, HAS_ZERO=False,
                                                                   HAS_MIN=False, GROUP=128, SCALE_ON_ACC=False)
    s = w.scales
    ptrs = (s, w.zeros if w.zeros is not None else s, w.mins if w.mins is not None else s,
            w.codebook if w.codebook is not None else s)
    return ptrs, (w.qweight.stride(0), w.qweight.stride(1), s.stride(0), s.stride(1)), dict(
        QUANT=True, NF4=w.codebook is not None, HAS_ZERO=w.zeros is not None, HAS_MIN=w.mins is not None,
        GROUP=w.group_size, SCALE_ON_ACC=SCALE_ON_ACC and w.codebook is None and w.mins is None
        and (w.group_size == -1 or w.group_size >= 128))


def _dot_flags(plan: dict, fmt: dict, dtype: torch.dtype) -> dict:
    """The tl.dot kernels' operand options: for 4-bit int4 experts in whole-tile scale groups with 16-bit
    activations, operands made by integer ops (PACKED, plan["PACKED"]) and the weight rows as the MMA's M
    (SWAP_AB, plan["SWAP_AB"]), both on unless the plan says otherwise; dense weights and other formats: neither."""
    packed = fmt["SCALE_ON_ACC"] and dtype in (torch.float16, torch.bfloat16)
    return dict(PACKED=packed and bool(plan.get("PACKED", True)),
                SWAP_AB=packed and bool(plan.get("SWAP_AB", True)))


def _gemv_format(fmt: dict) -> dict:
    """The format constexprs the GEMV kernels take (they scale per group themselves: no SCALE_ON_ACC)."""
    return {**{key: fmt[key] for key in ("NF4", "HAS_ZERO", "HAS_MIN", "GROUP")},
            "EMULATE": _interpreting()}


def packed_gemv(w: QuantizedExperts, dtype: torch.dtype) -> bool:
    """Whether 4-bit experts of this format run the packed-fp16 GEMVs with activations of `dtype`: int4 without
    minima, in scale groups of >= 128 columns or per channel, 16-bit activations (fp16 products would not hold
    fp32's precision); the rest run `_gate_up_gemv_kernel` / `_down_gemv_kernel`."""
    return (w.codebook is None and w.mins is None and (w.group_size == -1 or w.group_size >= 128)
            and dtype in (torch.float16, torch.bfloat16))


def _words_arg(w: QuantizedExperts, plan: dict):
    """The packed words as the kernel takes them: a pointer, or with plan["TMA"] a descriptor of [BLOCK_N, TILES,
    16] boxes over all experts' rows ([E * Np, tiles, 16], host-encoded per launch: free under CUDA graphs)."""
    q = w.qweight
    if not plan.get("TMA", False):
        return q
    if not q.is_contiguous():  # the descriptor spans the experts as one [E * Np] row range
        raise ValueError("TMA: a QuantizedExperts' qweight must be contiguous (QuantizedExperts makes it so)")
    e, np_, words = q.shape
    return TensorDescriptor(q, [e * np_, words // 16, 16], [words, 16, 1], [plan["BLOCK_N"], plan["TILES"], 16])


def _plan_choice(plan: dict, key: str, choices: tuple, default):
    """plan[key] (default when absent), refused by name unless one of `choices`."""
    value = plan.get(key, default)
    if value not in choices:
        raise ValueError(f"config: {key} must be one of {choices}, got {value!r}")
    return value


def _gemvs(x: torch.Tensor, w_gate_up: QuantizedExperts, w_down: QuantizedExperts, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, up: dict, down: dict, out: torch.Tensor) -> torch.Tensor | None:
    """The two expert GEMVs of a few tokens (one program per (token, slot) pair and block of output rows); returns
    the pairs' weighted outputs [P, H], or [splits, P, H] fp32 partial sums of a down GEMV split over K, or None
    where the down plan's FOLD_COMBINE had the down GEMV write `out` itself (E65).

    Plan keys of the packed GEMVs' dependent launches (E64 / E65, measured on the design page): the gate/up plan's
    "PDL_TRIGGER" ("end", the default: the down grid launches after each program's K loop; "start": right after
    its wait), the down plan's "PRELOAD_WORDS" (the words of its one loop step loaded before its wait) and
    "FOLD_COMBINE" (one split only). A plan's "MMA" runs that GEMV on tensor cores (`_gate_up_mma`, `_down_mma`;
    E78)."""
    T, H = x.shape
    top_k = topk_ids.shape[1]
    num_pairs, intermediate, num_routed = T * top_k, w_down.shape[1], w_down.num_experts
    gu_ptrs, gu_strides, gu_format = _weight_args(w_gate_up)
    dn_ptrs, dn_strides, dn_format = _weight_args(w_down)
    packed_up, packed_down = packed_gemv(w_gate_up, x.dtype), packed_gemv(w_down, x.dtype)
    trigger = _plan_choice(up, "PDL_TRIGGER", ("end", "start"), "end")
    preload = _plan_choice(down, "PRELOAD_WORDS", (False, True), False)
    fold = _plan_choice(down, "FOLD_COMBINE", (False, True), False)
    mma_up = _plan_choice(up, "MMA", (False, True), False)
    mma_down = _plan_choice(down, "MMA", (False, True), False)
    if (trigger != "end" or preload or fold) and not ((packed_up or mma_up) and (packed_down or mma_down)):
        raise ValueError("config: PDL_TRIGGER, PRELOAD_WORDS and FOLD_COMBINE apply to the packed-fp16 GEMVs only")
    if (preload or fold) and mma_down:
        raise ValueError("config: PRELOAD_WORDS and FOLD_COMBINE need the packed down GEMV, not MMA")
    for part, w, mma in (("gate_up", w_gate_up, mma_up), ("down", w_down, mma_down)):
        if mma and not mma_gemv_supported(x, w):
            raise ValueError(f"config: {part} MMA needs int4 experts without minima (groups of 32, 64, multiples of "
                             "128 or per channel) and fp16 / bf16 activations with 16-element aligned rows on an "
                             f"NVIDIA GPU of sm_80+ with Gluon; got {w.fmt} group {w.group_size}, {x.dtype} on "
                             f"{x.device}")
    # fp32 intermediate: the down GEMVs' x then needs no rounding before its own (exact or per-tile) conversion;
    # the tensor-core down GEMV takes it in the activations' dtype (its MMA's operand)
    inter = torch.empty(num_pairs, intermediate, dtype=x.dtype if mma_down else torch.float32, device=x.device)
    # the fold's arrival counts, a row block's a token (zeroed by the gate/up GEMV); without it never read
    down_blocks = triton.cdiv(H, down["BLOCK_N"]) if fold else 0
    counts = torch.empty(T * down_blocks, dtype=torch.int32, device=x.device) if fold else topk_ids
    if mma_up:
        _gate_up_mma(x, w_gate_up, inter, topk_ids, up, trigger == "start", counts, down_blocks)
    elif packed_up:
        _gate_up_h2_kernel[(num_pairs, triton.cdiv(intermediate, up["BLOCK_N"]))](
            x, _words_arg(w_gate_up, up), *gu_ptrs[:2], inter, topk_ids, counts,
            T, H, intermediate, num_routed, w_gate_up.padded_shape[0], down_blocks, x.stride(0),
            *gu_strides, inter.stride(0), TOP_K=top_k, TRIGGER_START=trigger == "start", ZERO_COUNTS=fold,
            **_h2_flags(up, x.dtype, H, triton.cdiv(H, 128), gu_format, x.device),
        )
    else:
        _gate_up_gemv_kernel[(num_pairs, triton.cdiv(intermediate, up["BLOCK_N"]))](
            x, _words(w_gate_up), *gu_ptrs, inter, topk_ids,
            T, H, intermediate, num_routed, x.stride(0), *gu_strides, inter.stride(0),
            TOP_K=top_k, BLOCK_N=up["BLOCK_N"], TILES=up["TILES"], STAGES=up["num_stages"],
            EVEN_K=H % (128 * up["TILES"]) == 0, num_warps=up["num_warps"], **_gemv_format(gu_format),
        )
    if mma_down:
        return _down_mma(inter, w_down, topk_ids, topk_weights, down)
    if not packed_down:
        pair_out = torch.empty(num_pairs, H, dtype=x.dtype, device=x.device)
        _down_gemv_kernel[(num_pairs, triton.cdiv(H, down["BLOCK_N"]))](
            inter, _words(w_down), *dn_ptrs, pair_out, topk_ids, topk_weights,
            T, H, intermediate, num_routed, inter.stride(0), *dn_strides, pair_out.stride(0),
            BLOCK_N=down["BLOCK_N"], TILES=down["TILES"], STAGES=down["num_stages"],
            EVEN_K=intermediate % (128 * down["TILES"]) == 0, num_warps=down["num_warps"],
            **_gemv_format(dn_format),
        )
        return pair_out
    num_tiles = triton.cdiv(intermediate, 128)
    per_split = triton.cdiv(triton.cdiv(num_tiles, down.get("SPLIT_K", 1)), down["TILES"]) * down["TILES"]
    splits = triton.cdiv(num_tiles, per_split)
    if preload and per_split != down["TILES"]:
        raise ValueError("config: PRELOAD_WORDS needs a down GEMV of one loop step (its K range of at most "
                         f"TILES = {down['TILES']} tiles), got {per_split} tiles a split")
    if fold and splits > 1:
        raise ValueError(f"config: FOLD_COMBINE needs one split of the down GEMV, got SPLIT_K {down['SPLIT_K']}")
    # one split writes the pairs' outputs in the activations' dtype; more write fp32 partials the combine adds
    pair_out = (torch.empty(num_pairs, H, dtype=x.dtype, device=x.device) if splits == 1 else
                torch.empty(splits, num_pairs, H, dtype=torch.float32, device=x.device))
    _down_h2_kernel[(num_pairs, triton.cdiv(H, down["BLOCK_N"]), splits)](
        inter, _words_arg(w_down, down), *dn_ptrs[:2], pair_out, topk_ids, topk_weights, counts, out,
        T, H, intermediate, num_routed, w_down.padded_shape[0], per_split, inter.stride(0), *dn_strides,
        pair_out.stride(-2), pair_out.stride(0) if splits > 1 else 0, out.stride(0),
        TOP_K=top_k, PRELOAD=preload, FOLD=fold,
        **_h2_flags(down, inter.dtype, intermediate, per_split, dn_format, x.device),
    )
    return None if fold else pair_out


def mma_gemv_supported(x: torch.Tensor, w: QuantizedExperts) -> bool:
    """Whether the tensor-core GEMVs (`mma._gate_up_mma_kernel`, `_down_mma_kernel`) run these experts: int4
    without minima in scale groups of 32, 64, multiples of 128 or per channel, fp16 / bf16 activations whose rows
    their cp.async ring copies in 16-byte pieces, on an NVIDIA GPU of sm_80 or later with the Triton release the
    Gluon kernels were built for."""
    g = w.group_size
    if w.codebook is not None or w.mins is not None or not (g == -1 or g % 128 == 0 or g in (32, 64)):
        return False
    if x.dtype not in (torch.float16, torch.bfloat16) or x.stride(-1) != 1 or x.stride(0) % 16 or x.shape[1] % 16:
        return False
    if _interpreting() or x.device.type != "cuda" or torch.version.hip is not None or x.data_ptr() % 16:
        return False
    return _capability(x.device) >= (8, 0) and _gluon_available()


def _gate_up_mma(x: torch.Tensor, w: QuantizedExperts, inter: torch.Tensor, topk_ids: torch.Tensor, plan: dict,
                 trigger_start: bool, counts: torch.Tensor | None = None, count_blocks: int = 0) -> None:
    """`mma._gate_up_mma_kernel` into `inter` [P, I] (fp32, or the activations' dtype before a tensor-core down
    GEMV): one program per (token, slot) pair and 16 x num_warps rows of the intermediate, TILES K-tiles an
    iteration through a ring of num_stages (>= 2) slots. With `count_blocks` (the down plan's FOLD_COMBINE) it
    zeroes each token's `count_blocks` arrival counts in `counts` first."""
    # imported here: Triton builds without Gluon never reach this launcher (`_gemvs` checks `mma_gemv_supported`)
    from .mma import _gate_up_mma_kernel

    warps, tiles, stages = _mma_plan(plan, 1)
    intermediate = w.shape[0] // 2
    if intermediate % (16 * warps):  # a program's up half would reach past the up rows
        raise ValueError(f"config: the gate/up MMA needs 16 x num_warps to divide the intermediate size "
                         f"({intermediate}); got {plan}")
    ptrs, strides, flags = _mma_weight_args(w)
    pdl = _pdl(plan, x.device)
    hidden = x.shape[1]
    _gate_up_mma_kernel[(topk_ids.numel(), intermediate // (16 * warps))](
        x, *ptrs, inter, topk_ids, topk_ids if counts is None else counts, hidden, intermediate, w.num_experts,
        count_blocks, x.stride(0), *strides, inter.stride(0), TOP_K=topk_ids.shape[1], TILES=tiles, STAGES=stages,
        MASK_K=hidden % 128 != 0, PDL=pdl, launch_pdl=pdl, TRIGGER_START=trigger_start,
        ZERO_COUNTS=count_blocks > 0, num_warps=warps, **flags,
    )


def _mma_weight_args(w: QuantizedExperts) -> tuple[tuple, tuple, dict]:
    """(words, scales, zero points) pointers, strides and format constexprs of the tensor-core GEMVs (per channel:
    GROUP 128, unread, and PER_CHANNEL)."""
    _, strides, fmt = _weight_args(w)
    flags = dict(GROUP=128 if fmt["GROUP"] == -1 else fmt["GROUP"], PER_CHANNEL=fmt["GROUP"] == -1,
                 HAS_ZERO=fmt["HAS_ZERO"])
    return (w.qweight, w.scales, _or(w.zeros, w.scales)), strides, flags


def _mma_plan(plan: dict, reps: int) -> tuple[int, int, int]:
    """(num_warps, TILES, num_stages) of a tensor-core GEMV plan, refused by name unless 1-8 warps, 1-8 K-tiles an
    iteration (a power of two) and a ring of >= 2 slots, with 16 x num_warps x `reps` rows a program at most
    PAD_N (a program's rows stay within the padded rows)."""
    warps, tiles, stages = plan.get("num_warps", 4), plan.get("TILES", 4), plan.get("num_stages", 2)
    if (warps not in (1, 2, 4, 8) or 16 * warps * reps > PAD_N or tiles not in (1, 2, 4, 8)
            or not isinstance(stages, int) or stages < 2):
        raise ValueError(f"config: MMA needs num_warps 1-8 (16 x num_warps x {reps} rows at most {PAD_N}), TILES 1, "
                         f"2, 4 or 8 and num_stages >= 2; got {plan}")
    return warps, tiles, stages


def _down_mma(inter: torch.Tensor, w: QuantizedExperts, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              plan: dict) -> torch.Tensor:
    """`mma._down_mma_kernel` of `inter` [P, I] (the activations' dtype): one program per (token, slot) pair, 16 x
    num_warps x REPS output rows and K split (SPLIT_K); returns the pairs' weighted outputs [P, H], or [splits, P,
    H] fp32 partial sums for the combine."""
    from .mma import _down_mma_kernel

    reps = plan.get("REPS", 1)
    if reps not in (1, 2):
        raise ValueError(f"config: MMA's REPS must be 1 or 2, got {reps!r}")
    warps, tiles, stages = _mma_plan(plan, reps)
    (num_pairs, intermediate), hidden = inter.shape, w.shape[0]
    if intermediate % 16:  # the ring copies the intermediate's rows in 16-byte pieces
        raise ValueError(f"config: the down MMA needs an intermediate size that is a multiple of 16, got "
                         f"{intermediate}")
    ptrs, strides, flags = _mma_weight_args(w)
    num_tiles = triton.cdiv(intermediate, 128)
    per_split = triton.cdiv(num_tiles, plan.get("SPLIT_K", 1))
    splits = triton.cdiv(num_tiles, per_split)
    pair_out = (torch.empty(num_pairs, hidden, dtype=inter.dtype, device=inter.device) if splits == 1 else
                torch.empty(splits, num_pairs, hidden, dtype=torch.float32, device=inter.device))
    pdl = _pdl(plan, inter.device)
    _down_mma_kernel[(num_pairs, triton.cdiv(hidden, 16 * warps * reps), splits)](
        inter, *ptrs, pair_out, topk_ids, topk_weights, hidden, intermediate, w.num_experts, per_split,
        inter.stride(0), *strides, pair_out.stride(-2), pair_out.stride(0) if splits > 1 else 0, REPS=reps,
        TILES=tiles, STAGES=stages, MASK_K=intermediate % 128 != 0, PDL=pdl, launch_pdl=pdl, num_warps=warps,
        **flags,
    )
    return pair_out


def _streams(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, shared_gu: torch.Tensor,
             shared_dn: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, has_shared: bool,
             pair_out: torch.Tensor, up: dict, down: dict, programs_per_sm: int) -> bool:
    """The two expert GEMVs of one token with 16-bit or fp32 experts as stream kernels (`_gate_up_stream_kernel`):
    each GEMV's (pair, block of BLOCK_N rows) items over at most programs_per_sm programs per SM, the pairs'
    weighted outputs into pair_out [P, H]. Returns whether the combine may launch as the down kernel's
    dependent."""
    H = x.shape[1]
    num_pairs, intermediate = topk_ids.numel(), w_down.shape[2]
    num_routed = w_down.shape[0]
    if not (isinstance(programs_per_sm, int) and programs_per_sm >= 1):
        raise ValueError(f"config: STREAM must be a positive int (programs per SM), got {programs_per_sm!r}")
    sms = _sm_count(x.device)
    inter = torch.empty(num_pairs, intermediate, dtype=x.dtype, device=x.device)

    def launch(plan: dict, n: int, k: int) -> tuple:
        """(grid, n_blocks, items, flags) of one GEMV: its (pair, row block) items over the programs."""
        pdl = _pdl(plan, x.device, default=True)
        n_blocks = triton.cdiv(n, plan["BLOCK_N"])
        num_items = num_pairs * n_blocks
        flags = dict(HAS_SHARED=has_shared, BLOCK_N=plan["BLOCK_N"], BLOCK_K=plan["BLOCK_K"],
                     K_STEPS=triton.cdiv(k, plan["BLOCK_K"]), STAGES=plan["num_stages"], PDL=pdl, launch_pdl=pdl,
                     num_warps=plan["num_warps"])
        return (min(num_items, sms * programs_per_sm),), n_blocks, num_items, flags

    grid, n_blocks, num_items, flags = launch(up, intermediate, H)
    _gate_up_stream_kernel[grid](
        x, w_gate_up, shared_gu, inter, topk_ids, H, intermediate, num_routed, num_routed + int(has_shared),
        num_items, n_blocks, w_gate_up.stride(0), w_gate_up.stride(1), shared_gu.stride(-2), inter.stride(0), **flags)
    grid, n_blocks, num_items, flags = launch(down, H, intermediate)
    _down_stream_kernel[grid](
        inter, w_down, shared_dn, pair_out, topk_ids, topk_weights, H, intermediate, num_routed,
        num_routed + int(has_shared), num_items, n_blocks, inter.stride(0), w_down.stride(0), w_down.stride(1),
        shared_dn.stride(-2), pair_out.stride(0), **flags)
    return flags["PDL"]


def _pdl(plan: dict, device: torch.device, default: bool = False) -> bool:
    """Whether a kernel of this plan launches as a programmatic dependent of the one before (plan["PDL"], else
    `default`; CUDA sm_90+, not the interpreter)."""
    return bool(plan.get("PDL", default)) and _pdl_device(device)


def _pdl_device(device: torch.device) -> bool:
    """Whether kernels on `device` can launch as programmatic dependents (CUDA sm_90+, not the interpreter)."""
    return device.type == "cuda" and not _interpreting() and _capability(device)[0] >= 9


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability, asked once per device (the launchers check it on every call)."""
    return torch.cuda.get_device_capability(device)


def _h2_flags(plan: dict, x_dtype: torch.dtype, k: int, per_split: int, fmt: dict, device: torch.device) -> dict:
    """The launch options of a packed-fp16 GEMV: the plan's block sizes, the format, the x conversion, whether a
    loop step reaches past K or the last tile (MASK), programmatic dependent launch."""
    pdl = _pdl(plan, device)
    return dict(PDL=pdl, launch_pdl=pdl, BLOCK_N=plan["BLOCK_N"], TILES=plan["TILES"], STAGES=plan["num_stages"],
                HAS_ZERO=fmt["HAS_ZERO"], GROUP=fmt["GROUP"], X_SCALED=x_dtype != torch.float16,
                X_BCAST=bool(plan.get("X_BCAST", False)), W_DESC=bool(plan.get("TMA", False)),
                MASK=k % 128 != 0 or per_split % plan["TILES"] != 0 or triton.cdiv(k, 128) % per_split != 0,
                EMULATE=_interpreting(), num_warps=plan["num_warps"])


def _dequantized_columns(parts: list, dtype: torch.dtype, side: torch.cuda.Stream | None = None):
    """Chunks (part, col_lo, width, out) of the output columns of every expert of each part (w, cols, block_n,
    gate_up), dequantized into `dtype`, part after part: out [E, width, K] holds rows col_lo.. of each expert of w;
    with `gate_up` (w's rows are the gate rows, then the up rows `cols` further) [E, 2 width, K], the chunk's gate
    rows then its up rows. A chunk holds a multiple of block_n columns (the last one the rest, at least block_n
    columns). Chunks of columns over all experts, not of experts: each grouped launch then covers exactly its
    chunk's tiles (with chunks of experts every launch also ran every other expert's blocks, as programs that return
    at once but still take an SM slot each).

    Without `side` one buffer of DEQUANT_CHUNK_BYTES serves every chunk, each dequantized on the caller's stream
    when the caller asks for it. With `side` (a CUDA stream) two buffers of half that: chunk i + 1 is dequantized on
    `side` while the caller's stream runs what it queued for chunk i (the grouped kernels: compute-bound, the
    dequantization memory-bound), each chunk waited for on the caller's stream before it is handed out and each
    buffer refilled only after the caller's work on its last chunk; one fork from and one join into the caller's
    stream, so CUDA-graph capture takes it."""
    budget = DEQUANT_CHUNK_BYTES // (2 if side is not None else 1)
    chunks, numel = [], 0
    for index, (w, cols, block_n, gate_up) in enumerate(parts):
        per_col = w.num_experts * (2 if gate_up else 1) * w.shape[1]
        width = min(cols, max(block_n, budget // (per_col * dtype.itemsize) // block_n * block_n))
        numel = max(numel, per_col * width)
        chunks += [(index, col_lo, min(width, cols - col_lo)) for col_lo in range(0, cols, width)]
    device = parts[0][0].qweight.device
    buffers = [torch.empty(numel, dtype=dtype, device=device) for _ in range(1 if side is None else 2)]

    def dequantize(i):
        index, col_lo, count = chunks[i]
        w, cols, _, gate_up = parts[index]
        halves, k = (2 if gate_up else 1), w.shape[1]
        out = buffers[i % len(buffers)][:w.num_experts * halves * count * k].view(w.num_experts, halves * count, k)
        (s, z, m, cb), (stride_we, stride_wn, stride_se, stride_sg), fmt = _weight_args(w)
        for half in range(halves):
            dst = out[:, half * count:(half + 1) * count]
            _dequantize_kernel[(w.num_experts, triton.cdiv(count, DEQUANT_BLOCK_N), triton.cdiv(k, 128))](
                w.qweight, s, z, m, cb, dst, half * cols + col_lo, count, k,
                stride_we, stride_wn, stride_se, stride_sg, dst.stride(0), dst.stride(1),
                NF4=fmt["NF4"], HAS_ZERO=fmt["HAS_ZERO"], HAS_MIN=fmt["HAS_MIN"], GROUP=fmt["GROUP"],
                BLOCK_N=DEQUANT_BLOCK_N, num_warps=4,
            )
        return (index, col_lo, count, out)

    if side is None:
        for i in range(len(chunks)):
            yield dequantize(i)
        return
    caller = torch.cuda.current_stream(device)
    side.wait_stream(caller)  # the fork: the side stream starts after the caller's work so far
    done, used = [], []  # per chunk: its dequantization, the caller's work on it (events)

    def ahead(i):  # chunk i on the side stream, into the buffer chunk i - 2 used
        with torch.cuda.stream(side):
            if i >= 2:
                side.wait_event(used[i - 2])
            chunk = dequantize(i)
            done.append(side.record_event())
        return chunk

    try:
        upcoming = ahead(0)
        for i in range(len(chunks)):
            chunk = upcoming
            if i + 1 < len(chunks):
                upcoming = ahead(i + 1)
            caller.wait_event(done[i])
            yield chunk
            used.append(caller.record_event())
    finally:  # the join, also when the caller stops early: the buffers are freed on the caller's stream
        caller.wait_stream(side)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that dequantizes the next chunk of 4-bit experts (`_dequantized_columns`), one per device."""
    return torch.cuda.Stream(device)


# Triton releases (major.minor) the Gluon kernel (`wgmma`, and `warp_specialize`'s PTX edit) was written and
# GPU-tested against: Gluon is experimental and changes between releases (Triton 3.9 removed the TMA copy names it
# calls, and later releases call the stage hook `unlooped_workers` sets with no arguments). Elsewhere its configs run
# the Triton-language kernels.
GLUON_TRITON_RELEASES = ("3.6",)


def gluon_release(triton_version: str) -> bool:
    """Whether a Triton of version `triton_version` (``"3.6.0"``) is a release the Gluon kernel was built for."""
    return ".".join(triton_version.split(".")[:2]) in GLUON_TRITON_RELEASES


@functools.cache
def _gluon_available() -> bool:
    """Whether this Triton is a release the Gluon kernel was built for and has the Gluon ops it imports (elsewhere
    a warning, once)."""
    if not gluon_release(triton.__version__):
        logger.warning("moe-dispatch: the Gluon expert kernel was built for Triton %s, this is Triton %s; 4-bit "
                       "experts run the Triton-language grouped kernels instead (slower at many tokens, exact)",
                       " / ".join(GLUON_TRITON_RELEASES), triton.__version__)
        return False
    try:
        importlib.import_module(".wgmma", __package__)
    except ImportError:
        return False
    return True


def grouped_wgmma_supported(x: torch.Tensor, w_gate_up, w_down) -> bool:
    """Whether the Gluon grouped kernel (`wgmma`) runs these experts: 4-bit int4 experts (not NF4), fp16 / bf16
    activations on a Hopper GPU (wgmma is sm_90a only) with the Triton release it was built for, and rows of x
    and of the intermediate that TMA can read (H and I multiples of 8)."""
    if not (isinstance(w_gate_up, QuantizedExperts) and isinstance(w_down, QuantizedExperts)):
        return False
    if w_gate_up.codebook is not None or w_down.codebook is not None:
        return False
    if x.dtype not in (torch.float16, torch.bfloat16) or x.shape[1] % 8 or w_down.shape[1] % 8:
        return False
    if _interpreting() or x.device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(x.device) == (9, 0) and _gluon_available()


# Hopper's shared memory a CTA may opt into (H100 / H200), of which the ring and the output tiles take their share
_SM90_SHARED_BYTES = 232448 - 2048


def wgmma_min_pairs(hidden: int, intermediate: int) -> int:
    """(token, slot) pairs per expert from which 4-bit int4 experts run the Gluon grouped kernel by default:
    WGMMA_MIN_PAIRS, or half that where both GEMMs' K span WGMMA_LONG_K_TILES K-tiles or more."""
    long_k = min(hidden, intermediate) >= WGMMA_LONG_K_TILES * 128
    return WGMMA_MIN_PAIRS // 2 if long_k else WGMMA_MIN_PAIRS


def _grouped_wgmma(x: torch.Tensor, w_gate_up: QuantizedExperts, w_down: QuantizedExperts,
                   topk_weights: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                   inter: torch.Tensor, top_k: int, block_m: int, plan: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped gate / up and down GEMMs of 4-bit experts as `wgmma._grouped_wgmma_kernel` launches, after
    the activations gathered into sorted order: `inter` [rows, I] gets SiLU(gate) * up of each sorted row. Returns
    (each sorted row's weighted output [rows, H], each pair's sorted row [P]) for the combine. plan:
    {"num_stages": ring stages (default 3; a GEMM whose output tiles leave room for fewer takes fewer)}."""
    # imported here: Triton builds without Gluon's Hopper ops never reach this launcher (`grouped_wgmma_supported`)
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from .warp_specialize import unlooped_workers
    from .wgmma import _grouped_wgmma_kernel

    stages = plan.get("num_stages", 3)
    if block_m not in (64, 128) or not isinstance(stages, int) or not 2 <= stages <= 4:
        raise ValueError(f"config: WGMMA needs BLOCK_M 64 or 128 and num_stages 2-4; got BLOCK_M {block_m}, {plan}")
    rows, hidden = sorted_ids.shape[0], x.shape[1]
    max_blocks = block_expert.shape[0]
    num_pairs = topk_weights.numel()
    dtype = gl.float16 if x.dtype == torch.float16 else gl.bfloat16
    x_sorted = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    out_sorted = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    pair_rows = torch.empty(num_pairs, dtype=torch.int32, device=x.device)
    _gather_rows_kernel[(max_blocks, triton.cdiv(hidden, 64))](
        x, x_sorted, pair_rows, sorted_ids, block_expert, num_pairs, hidden, x.stride(0), x_sorted.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_H=64, num_warps=4,
    )

    def rows_desc(t, box):  # a [rows, cols] tensor in the activations' dtype, in [block_m, box] boxes
        return GluonDescriptor(t, list(t.shape), [t.stride(0), 1], [block_m, box],
                               gl.NVMMASharedLayout.get_default_for([block_m, box], dtype))

    sms = _sm_count(x.device)
    stage_bytes = 2 * 128 * 16 * 4 + block_m * 128 * x.element_size()  # two word boxes and x's tile
    for w, a, out, swiglu in ((w_gate_up, x_sorted, inter, True), (w_down, inter, out_sorted, False)):
        q = w.qweight
        if not q.is_contiguous():  # the descriptor spans the experts as one row range
            raise ValueError("WGMMA: a QuantizedExperts' qweight must be contiguous (QuantizedExperts makes it so)")
        experts_, padded, words = q.shape
        w_desc = GluonDescriptor(q.view(experts_ * padded, words), [experts_ * padded, words], [words, 1], [128, 16],
                                 gl.NVMMASharedLayout.get_default_for([128, 16], gl.int32))
        n_out = w.shape[0] // 2 if swiglu else w.shape[0]
        columns = triton.cdiv(n_out, 128 if swiglu else 256)
        tiles_bytes = (2 if swiglu else 4) * block_m * 64 * x.element_size()  # its output tiles (`wgmma`)
        s = w.scales
        with unlooped_workers(_grouped_wgmma_kernel.__name__):
            _grouped_wgmma_kernel[(min(max_blocks * columns, sms),)](
                rows_desc(a, 128), w_desc, s, _or(w.zeros, s), _or(w.mins, s), block_expert, sorted_ids,
                topk_weights, rows_desc(out, 64), max_blocks, columns, words // 16, padded,
                n_out if swiglu else 128, s.stride(0), s.stride(1), num_pairs,
                GROUP=128 if w.group_size == -1 else w.group_size, PER_CHANNEL=w.group_size == -1,
                HAS_ZERO=w.zeros is not None, HAS_MIN=w.mins is not None, SWIGLU=swiglu,
                STAGES=min(stages, (_SM90_SHARED_BYTES - tiles_bytes) // stage_bytes), num_warps=4,
            )
    return out_sorted, pair_rows


def _or(t, fallback):
    return fallback if t is None else t


def experts(hidden_states: torch.Tensor, w_gate_up, w_down,
            topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, *,
            shared_gate_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
            hist: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Writes sum_j w[t, j] * expert_{ids[t, j]}(x[t]) into `out` [T, H].

    Ids in [0, E) are routed experts, id E the shared expert when `shared_gate_up` is given, any other id
    selects nothing. `hist` is the routing kernel's per-chunk histogram (computed here when None);
    `config` overrides the block sizes (tuning). Inputs must be contiguous in their last dimension,
    topk_weights and topk_ids contiguous.
    """
    T, H = hidden_states.shape
    quant = isinstance(w_down, QuantizedExperts)
    num_routed, intermediate = (w_down.num_experts, w_down.shape[1]) if quant else (w_down.shape[0], w_down.shape[2])
    top_k = topk_ids.shape[1]
    has_shared = shared_gate_up is not None
    if quant and has_shared:
        raise ValueError("shared_gate_up: a shared expert does not ride along with 4-bit experts; add it separately")
    num_experts = num_routed + int(has_shared)
    if T == 0:
        return out
    if (config is not None and "WGMMA" in config
            and not (T > DECODE_MAX_TOKENS and grouped_wgmma_supported(hidden_states, w_gate_up, w_down))):
        config = None  # a plan of the Gluon kernel where it does not apply: the default path, same results
    if config is None:
        if (quant and T > DECODE_MAX_TOKENS and T * top_k >= wgmma_min_pairs(H, intermediate) * num_routed
                and grouped_wgmma_supported(hidden_states, w_gate_up, w_down)):
            config = WGMMA_PLAN
        elif quant and T * top_k >= DEQUANT_MIN_PAIRS * num_routed:  # then the bf16 kernels, with their tables
            config = {"DEQUANT": True, **get_config(T, num_routed, H, intermediate, top_k, hidden_states.dtype,
                                                    hidden_states.device)}
        elif quant:  # the tuned tables were measured with 16-bit weights: 4-bit experts take the heuristic
            config = default_config(T, num_routed, H, intermediate, top_k, hidden_states.device, quantized=True,
                                    packed=packed_gemv(w_down, hidden_states.dtype))
        else:
            config = get_config(T, num_routed, H, intermediate, top_k, hidden_states.dtype, hidden_states.device)
    wgmma = "WGMMA" in config
    dequant = quant and bool(config.get("DEQUANT", False))
    if (dequant or wgmma) and "BLOCK_M" not in config:
        raise ValueError("config: DEQUANT and WGMMA run grouped kernels, so they need a BLOCK_M")
    if wgmma:  # its own plan (`_grouped_wgmma`)
        up = down = None
    else:
        config = _for_weights(config, quant) if quant and not dequant else _for_dtype(config, hidden_states.dtype)
        up, down = config["gate_up"], config["down"]
    common = dict(HAS_SHARED=has_shared, PRECISION=_precision(hidden_states.dtype),
                  UPCAST=_upcast_dots(hidden_states.dtype))
    shared_gu = shared_gate_up if has_shared else _words(w_gate_up)
    shared_dn = shared_down if has_shared else _words(w_down)
    gu_ptrs, gu_strides, gu_format = _weight_args(w_gate_up)
    dn_ptrs, dn_strides, dn_format = _weight_args(w_down)
    num_pairs = T * top_k
    device = hidden_states.device
    gemv = quant and config.get("GEMV", False)
    # the GEMVs size their own output (split-K partials); the other paths write one row per pair
    pair_out = None if gemv or wgmma else torch.empty(num_pairs, H, dtype=hidden_states.dtype, device=device)
    pair_rows = None  # each pair's row of pair_out where that is not the pair's index (`_grouped_wgmma`)
    combine_pdl = False  # whether the combine launches as a dependent of the down kernel
    with _device_guard(hidden_states):
        if gemv:
            pair_out = _gemvs(hidden_states, w_gate_up, w_down, topk_weights, topk_ids, up, down, out)
            if pair_out is None:  # the down GEMV wrote out (FOLD_COMBINE)
                return out
            combine_pdl = _pdl(down, device)
        elif T == 1 and not quant and "STREAM" in config:
            combine_pdl = _streams(hidden_states, w_gate_up, w_down, shared_gu, shared_dn, topk_weights, topk_ids,
                                   has_shared, pair_out, up, down, config["STREAM"])
        elif T <= DECODE_MAX_TOKENS and not dequant:
            # dependent launches unless a plan says "PDL": False (their A/B)
            up_pdl, down_pdl = _pdl(up, device, default=True), _pdl(down, device, default=True)
            combine_pdl = down_pdl
            common.update(TOP_K=top_k, BLOCK_T=16, BLOCK_P=triton.next_power_of_2(num_pairs),
                          K_POW2=triton.next_power_of_2(top_k))
            inter = torch.empty(num_pairs, intermediate, dtype=hidden_states.dtype, device=device)
            _gate_up_decode_kernel[(num_pairs, triton.cdiv(intermediate, up["BLOCK_N"]))](
                hidden_states, _words(w_gate_up), shared_gu, *gu_ptrs, inter, topk_ids,
                T, H, intermediate, num_routed, num_experts,
                hidden_states.stride(0), *gu_strides[:2], shared_gu.stride(-2), *gu_strides[2:], inter.stride(0),
                BLOCK_N=up["BLOCK_N"], BLOCK_K=up["BLOCK_K"], EVEN_K=H % up["BLOCK_K"] == 0,
                num_warps=up["num_warps"], num_stages=up["num_stages"], PDL=up_pdl, launch_pdl=up_pdl, **common,
                **gu_format, **_dot_flags(up, gu_format, hidden_states.dtype),
            )
            _down_decode_kernel[(num_pairs, triton.cdiv(H, down["BLOCK_N"]))](
                inter, _words(w_down), shared_dn, *dn_ptrs, pair_out, topk_ids, topk_weights,
                T, H, intermediate, num_routed, num_experts,
                inter.stride(0), *dn_strides[:2], shared_dn.stride(-2), *dn_strides[2:], pair_out.stride(0),
                BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"], EVEN_K=intermediate % down["BLOCK_K"] == 0,
                num_warps=down["num_warps"], num_stages=down["num_stages"], PDL=down_pdl, launch_pdl=down_pdl,
                **common, **dn_format, **_dot_flags(down, dn_format, hidden_states.dtype),
            )
        else:
            block_m = config["BLOCK_M"]
            k_pow2 = triton.next_power_of_2(top_k)
            num_bins = _num_bins(num_experts)
            num_chunks = triton.cdiv(T, CHUNK_TOKENS)
            if hist is None:
                hist = torch.empty(num_chunks, num_bins, dtype=torch.int32, device=device)
                _histogram_kernel[(num_chunks,)](topk_ids, hist, T, num_experts, TOP_K=top_k, K_POW2=k_pow2,
                                                 CHUNK_T=CHUNK_TOKENS, NUM_BINS=num_bins)
            max_blocks = num_pairs // block_m + min(num_experts, num_pairs)
            sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
            block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
            _align_kernel[(num_chunks,)](
                topk_ids, hist, sorted_ids, block_expert, T, num_experts, num_chunks, max_blocks,
                TOP_K=top_k, K_POW2=k_pow2, CHUNK_T=CHUNK_TOKENS, NUM_BINS=num_bins, BLOCK_M=block_m,
                HIST_ROWS=max(1, 8192 // num_bins), FILL_BLOCKS=max(16, min(128, 8192 // num_bins)), num_warps=8,
            )
            inter = torch.empty(max_blocks * block_m, intermediate, dtype=hidden_states.dtype, device=device)

            def gate_up(w_gu, col_lo, cols, up_row):
                """`_gate_up_grouped_kernel` over the intermediate columns [col_lo, col_lo + cols)."""
                gu_ptrs, gu_strides, gu_format = _weight_args(w_gu)
                shared_gu = shared_gate_up if has_shared else _words(w_gu)
                _gate_up_grouped_kernel[(max_blocks * triton.cdiv(cols, up["BLOCK_N"]),)](
                    hidden_states, _words(w_gu), shared_gu, *gu_ptrs, inter, sorted_ids, block_expert,
                    num_pairs, H, intermediate, max_blocks, num_routed, col_lo, cols, up_row,
                    hidden_states.stride(0), *gu_strides[:2], shared_gu.stride(-2), *gu_strides[2:], inter.stride(0),
                    TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=up["BLOCK_N"], BLOCK_K=up["BLOCK_K"],
                    GROUP_M=up["GROUP_M"], EVEN_K=H % up["BLOCK_K"] == 0, num_warps=up["num_warps"],
                    num_stages=up["num_stages"], **common, **gu_format,
                    **_dot_flags(up, gu_format, hidden_states.dtype),
                )

            def down_proj(w_dn, col_lo, cols):
                """`_down_grouped_kernel` over the output columns [col_lo, col_lo + cols)."""
                dn_ptrs, dn_strides, dn_format = _weight_args(w_dn)
                shared_dn = shared_down if has_shared else _words(w_dn)
                _down_grouped_kernel[(max_blocks * triton.cdiv(cols, down["BLOCK_N"]),)](
                    inter, _words(w_dn), shared_dn, *dn_ptrs, pair_out, sorted_ids, block_expert, topk_weights,
                    num_pairs, H, intermediate, max_blocks, num_routed, col_lo, cols,
                    inter.stride(0), *dn_strides[:2], shared_dn.stride(-2), *dn_strides[2:], pair_out.stride(0),
                    BLOCK_M=block_m, BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"], GROUP_M=down["GROUP_M"],
                    EVEN_K=intermediate % down["BLOCK_K"] == 0, num_warps=down["num_warps"],
                    num_stages=down["num_stages"], **common, **dn_format,
                    **_dot_flags(down, dn_format, hidden_states.dtype),
                )

            if wgmma:
                pair_out, pair_rows = _grouped_wgmma(hidden_states, w_gate_up, w_down, topk_weights, sorted_ids,
                                                     block_expert, inter, top_k, block_m, config["WGMMA"])
            elif dequant:
                parts = [(w_gate_up, intermediate, up["BLOCK_N"], True), (w_down, H, down["BLOCK_N"], False)]
                side = _side_stream(device) if DEQUANT_OVERLAP and device.type == "cuda" else None
                for part, col_lo, cols, w16 in _dequantized_columns(parts, hidden_states.dtype, side):
                    if part == 0:
                        gate_up(w16, col_lo, cols, cols)
                    else:
                        down_proj(w16, col_lo, cols)
            else:
                gate_up(w_gate_up, 0, intermediate, intermediate)
                down_proj(w_down, 0, H)
        block_h = min(1024, triton.next_power_of_2(H))
        splits = pair_out.shape[0] if pair_out.dim() == 3 else 1
        _combine_kernel[(T, triton.cdiv(H, block_h))](
            pair_out, topk_ids, topk_ids if pair_rows is None else pair_rows, out, H, num_experts,
            pair_out.stride(-2), out.stride(0), pair_out.stride(0), TOP_K=top_k, SPLITS=splits, BLOCK_H=block_h,
            ROWS=pair_rows is not None, PDL=combine_pdl, num_warps=4, launch_pdl=combine_pdl,
        )
    return out


def moe_forward(hidden_states: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, top_k: int, sigmoid: bool, renormalize: bool,
                correction_bias: torch.Tensor | None, num_groups: int, topk_groups: int, scaling_factor: float,
                shared_gate_up: torch.Tensor | None, shared_down: torch.Tensor | None,
                out: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """The whole block into `out`; the shared expert (if any) must have the routed intermediate size."""
    T = hidden_states.shape[0]
    has_shared = shared_gate_up is not None
    routing = (top_k, sigmoid, renormalize, correction_bias, num_groups, topk_groups, scaling_factor)
    if T <= ROUTER_GEMV_MAX_TOKENS:  # the router GEMV spread over the GPU, the routing kernel as its dependent
        weights, ids = route(None, *routing, hidden_states=hidden_states, router_weight=router_weight,
                             shared_slot=has_shared)
        hist = None
    elif T <= DECODE_MAX_TOKENS:
        # a GEMM over all router rows needs the whole GPU: cuBLAS, then the routing kernel
        logits = torch.nn.functional.linear(hidden_states.to(router_weight.dtype), router_weight)
        weights, ids = route(logits, *routing, shared_slot=has_shared)
        hist = None
    else:
        num_bins = _num_bins(router_weight.shape[0] + int(has_shared))
        hist = torch.empty(triton.cdiv(T, CHUNK_TOKENS), num_bins, dtype=torch.int32, device=hidden_states.device)
        weights, ids = route(None, *routing, hidden_states=hidden_states, router_weight=router_weight,
                             shared_slot=has_shared, hist=hist)
    return experts(hidden_states, w_gate_up, w_down, weights, ids, out,
                   shared_gate_up=shared_gate_up, shared_down=shared_down, hist=hist, config=config)
