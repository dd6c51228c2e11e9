"""Triton kernels of the fused MoE layer and their launchers.

Launches for a whole layer (`moe_forward`), none of them sized by device data (no host syncs):

- T <= DECODE_MAX_TOKENS (decode): router logits (cuBLAS) -> `_route_kernel` -> `_gate_up_decode_kernel`
  -> `_down_decode_kernel` -> `_combine_kernel`. No sort: each program takes one (token, slot) pair and
  works only if that pair is the first to name its expert, so every selected expert's weights are
  streamed once, by many programs at a time.
- larger T: `_route_kernel` (router GEMM fused, also writes a per-chunk expert histogram) -> `_align_kernel`
  (pairs sorted by expert, each expert padded to BLOCK_M) -> `_gate_up_grouped_kernel` (gathers token rows
  on load, SiLU(gate) * up epilogue) -> `_down_grouped_kernel` (routing weight applied in fp32) ->
  `_combine_kernel` (sum over the top-k slots in slot order: deterministic, no atomics).

`fused_experts` with caller-given ids runs `_histogram_kernel` in place of the router.

4-bit experts (`QuantizedExperts`, quantized.py) run the same launches: the four expert kernels take
QUANT=True and the format as constexprs (NF4, HAS_ZERO, HAS_MIN, GROUP); their K loops then step one packed
tile (128 columns, 16 words per row) at a time and dequantize it in registers (`_dequant_tile`) into the
operand of the same tl.dot. At T <= GEMV_MAX_TOKENS `_gate_up_gemv_kernel` / `_down_gemv_kernel` replace the
two decode kernels (no tensor cores). No shared expert rides along with them (the op adds a dense one after).

Buffers are sized by upper bounds known from shapes: the padded pair count is at most
(T*k // BLOCK_M + min(E, T*k)) * BLOCK_M <= T*k + E*(BLOCK_M-1). A shared expert of the routed experts'
intermediate size rides along as expert E in an extra top-k slot of weight 1.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from .quantized import QuantizedExperts

DECODE_MAX_TOKENS = 16  # up to this many tokens one 16-row tile holds them all: the decode kernels run
CHUNK_TOKENS = 64  # tokens per routing chunk; the sort places one chunk per program
CONFIG_DIR = Path(__file__).parent / "configs"
logger = logging.getLogger(__name__)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the Triton interpreter multiplies bf16 operands as their raw bits; give it fp32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


# ----------------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T"])
def _route_kernel(
    logits_ptr, x_ptr, router_w_ptr, bias_ptr, weights_ptr, ids_ptr, hist_ptr,
    T, E, H, stride_lt, stride_xt, stride_re, scaling_factor,
    TOP_K: tl.constexpr, OUT_K: tl.constexpr, K_POW2: tl.constexpr,
    SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    FUSED_LOGITS: tl.constexpr, WRITE_HIST: tl.constexpr, NUM_BINS: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    if FUSED_LOGITS:
        logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            x = tl.load(x_ptr + rows64[:, None] * stride_xt + hs[None, :],
                        mask=row_ok[:, None] & (hs < H)[None, :], other=0.0)
            w = tl.load(router_w_ptr + cols.to(tl.int64)[:, None] * stride_re + hs[None, :],
                        mask=col_ok[:, None] & (hs < H)[None, :], other=0.0)
            logits = _dot(x.to(w.dtype), tl.trans(w), logits, PRECISION, UPCAST)
        # round like F.linear in the router weight's dtype, so decode (cuBLAS) and this path agree
        logits = logits.to(router_w_ptr.dtype.element_ty).to(tl.float32)
    else:
        logits = tl.load(logits_ptr + rows64[:, None] * stride_lt + cols[None, :],
                         mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)

    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        row_max = tl.max(tl.where(col_ok[None, :], logits, float("-inf")), axis=1)
        p = tl.where(col_ok[None, :], tl.exp(logits - row_max[:, None]), 0.0)
        scores = p / tl.sum(p, axis=1)[:, None]
    choice = scores
    if HAS_BIAS:  # the correction bias steers selection only; weights stay the plain scores
        choice += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(col_ok[None, :], choice, float("-inf"))

    if NUM_GROUPS > 1:  # DeepSeek-V3: keep the TOPK_GROUPS groups with the best top-2 sums
        group_of_col = cols // (E // NUM_GROUPS)
        gcols = tl.arange(0, GROUPS_POW2)
        group_scores = tl.full([BLOCK_T, GROUPS_POW2], float("-inf"), tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            in_group = tl.where((group_of_col == g)[None, :], choice, float("-inf"))
            best = tl.argmax(in_group, axis=1)
            second = tl.max(tl.where(cols[None, :] == best[:, None], float("-inf"), in_group), axis=1)
            group_scores = tl.where(gcols[None, :] == g, (tl.max(in_group, axis=1) + second)[:, None], group_scores)
        keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUPS):
            best_group = tl.argmax(group_scores, axis=1)
            keep = tl.where(group_of_col[None, :] == best_group[:, None], 1, keep)
            group_scores = tl.where(gcols[None, :] == best_group[:, None], float("-inf"), group_scores)
        choice = tl.where(keep != 0, choice, float("-inf"))

    # top-k by repeated argmax: descending, ties to the lower expert id, never a duplicate (-inf mask)
    kcols = tl.arange(0, K_POW2)
    top_w = tl.zeros([BLOCK_T, K_POW2], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1)
        picked = cols[None, :] == best[:, None]
        top_w = tl.where(kcols[None, :] == j, tl.sum(tl.where(picked, scores, 0.0), axis=1)[:, None], top_w)
        top_i = tl.where(kcols[None, :] == j, best.to(tl.int32)[:, None], top_i)
        choice = tl.where(picked, float("-inf"), choice)
    if RENORMALIZE:
        denom = tl.sum(top_w, axis=1)
        if SIGMOID:
            denom += 1e-20
        top_w = top_w / denom[:, None]
    top_w = top_w * scaling_factor
    if OUT_K > TOP_K:  # shared expert: expert id E, weight 1
        top_w = tl.where(kcols[None, :] == TOP_K, 1.0, top_w)
        top_i = tl.where(kcols[None, :] == TOP_K, E, top_i)
    out_ok = row_ok[:, None] & (kcols < OUT_K)[None, :]
    offs = rows64[:, None] * OUT_K + kcols[None, :]
    tl.store(weights_ptr + offs, top_w, mask=out_ok)
    tl.store(ids_ptr + offs, top_i, mask=out_ok)
    if WRITE_HIST:
        flat_ids = tl.reshape(top_i, [BLOCK_T * K_POW2])
        flat_ok = tl.reshape(out_ok.to(tl.int32), [BLOCK_T * K_POW2]) != 0
        tl.store(hist_ptr + pid * NUM_BINS + tl.arange(0, NUM_BINS), tl.histogram(flat_ids, NUM_BINS, mask=flat_ok))


# ----------------------------------------------------------------------------------------------------
# Sort by expert (large T)
# ----------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T"])
def _histogram_kernel(ids_ptr, hist_ptr, T, num_experts,
                      TOP_K: tl.constexpr, K_POW2: tl.constexpr, CHUNK_T: tl.constexpr, NUM_BINS: tl.constexpr):
    pid = tl.program_id(0)
    local = tl.arange(0, CHUNK_T * K_POW2)
    t = pid * CHUNK_T + local // K_POW2
    j = local % K_POW2
    in_range = (t < T) & (j < TOP_K)
    ids = tl.load(ids_ptr + t.to(tl.int64) * TOP_K + j, mask=in_range, other=-1)
    valid = in_range & (ids >= 0) & (ids < num_experts)
    hist = tl.histogram(tl.where(valid, ids, 0).to(tl.int32), NUM_BINS, mask=valid)
    tl.store(hist_ptr + pid * NUM_BINS + tl.arange(0, NUM_BINS), hist)


@triton.jit(do_not_specialize=["T", "num_chunks", "max_blocks"])
def _align_kernel(ids_ptr, hist_ptr, sorted_ids_ptr, block_expert_ptr,
                  T, num_experts, num_chunks, max_blocks,
                  TOP_K: tl.constexpr, K_POW2: tl.constexpr, CHUNK_T: tl.constexpr, NUM_BINS: tl.constexpr,
                  BLOCK_M: tl.constexpr, HIST_ROWS: tl.constexpr, FILL_BLOCKS: tl.constexpr):
    """Program p places chunk p's (token, slot) pairs; all programs read every chunk's histogram.

    sorted_ids[pos] = token * TOP_K + slot, or T * TOP_K at padding; block_expert[b] = the expert of rows
    [b * BLOCK_M, (b + 1) * BLOCK_M), or -1 past the last used block.
    """
    pid = tl.program_id(0)
    bins = tl.arange(0, NUM_BINS)
    total = tl.zeros([NUM_BINS], dtype=tl.int32)
    before = tl.zeros([NUM_BINS], dtype=tl.int32)
    for r0 in range(0, num_chunks, HIST_ROWS):
        r = r0 + tl.arange(0, HIST_ROWS)
        h = tl.load(hist_ptr + r[:, None] * NUM_BINS + bins[None, :], mask=(r < num_chunks)[:, None], other=0)
        total += tl.sum(h, axis=0)
        before += tl.sum(tl.where((r < pid)[:, None], h, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total_padded = tl.sum(padded, axis=0)

    # This chunk's pairs, sorted by (expert, pair): the i-th pair of expert e in the chunk goes to
    # starts[e] + before[e] + i. Invalid ids sort last and are not placed.
    CHUNK: tl.constexpr = CHUNK_T * K_POW2
    local = tl.arange(0, CHUNK)
    t = pid * CHUNK_T + local // K_POW2
    j = local % K_POW2
    in_range = (t < T) & (j < TOP_K)
    ids = tl.load(ids_ptr + t.to(tl.int64) * TOP_K + j, mask=in_range, other=-1)
    valid = in_range & (ids >= 0) & (ids < num_experts)
    expert = tl.where(valid, ids, NUM_BINS).to(tl.int32)
    own = tl.histogram(tl.where(valid, expert, 0), NUM_BINS, mask=valid)
    own_start = tl.cumsum(own, axis=0) - own
    key = tl.sort(expert * CHUNK + local)
    sorted_expert = key // CHUNK
    sorted_local = key % CHUNK
    placed = sorted_expert < NUM_BINS
    slot_base = tl.gather(starts + before - own_start, tl.where(placed, sorted_expert, 0), 0)
    pair = (pid * CHUNK_T + sorted_local // K_POW2) * TOP_K + sorted_local % K_POW2
    tl.store(sorted_ids_ptr + slot_base + local, pair, mask=placed)

    # Padding rows of the experts this program owns (e = pid mod num_chunks) get the sentinel.
    pad = tl.arange(0, BLOCK_M)
    pad_ok = ((bins % num_chunks) == pid)[:, None] & (pad[None, :] < (padded - total)[:, None])
    tl.store(sorted_ids_ptr + (starts + total)[:, None] + pad[None, :], T * TOP_K, mask=pad_ok)

    # Expert of each block in this program's share: the number of experts that end at or before it.
    share = tl.cdiv(max_blocks, num_chunks)
    first_block = pid * share
    last_block = tl.minimum(first_block + share, max_blocks)
    for b0 in range(first_block, last_block, FILL_BLOCKS):
        b = b0 + tl.arange(0, FILL_BLOCKS)
        row = b * BLOCK_M
        expert_of_block = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(row < total_padded, expert_of_block, -1), mask=b < last_block)


# ----------------------------------------------------------------------------------------------------
# Expert GEMMs
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _expert_weights(w_ptr, shared_ptr, e, num_routed, stride_we, stride_wn, stride_sn, HAS_SHARED: tl.constexpr):
    """Base pointer and row stride of expert e's weight matrix; expert id num_routed is the shared one."""
    base = w_ptr + e.to(tl.int64) * stride_we
    stride_n = stride_wn
    if HAS_SHARED:
        if e == num_routed:
            base = shared_ptr
            stride_n = stride_sn
    return base, stride_n


@triton.jit
def _swiglu_tile(a_ptrs, a_ok, g_ptrs, u_ptrs, n_ok, K, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """SiLU(A @ Wg^T) * (A @ Wu^T) in fp32 for one tile; A rows outside a_ok read as zero."""
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=a_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc_g = _dot(a, g, acc_g, PRECISION, UPCAST)
        acc_u = _dot(a, u, acc_u, PRECISION, UPCAST)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    return acc_g / (1.0 + tl.exp(-acc_g)) * acc_u


@triton.jit
def _matmul_tile(a_ptrs, a_ok, b_ptrs, n_ok, K, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """A @ W^T in fp32 for one tile; A rows outside a_ok read as zero."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=a_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = _dot(a, b, acc, PRECISION, UPCAST)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


# 4-bit experts (quantized.py's layout): one packed K-tile of 128 columns per step, dequantized in registers into
# a [BLOCK_N, 128] operand of the activation dtype, then one K=128 tl.dot; the same loop structure as the dense
# tiles above. The format is a set of constexprs (NF4, HAS_ZERO, HAS_MIN, GROUP), so each format compiles to
# its own straight-line dequantization and the dense kernels are unchanged (QUANT=False).
_MAGIC_BITS = tl.constexpr(0x4B000000)  # 2**23 as fp32 bits: (code | bits) read as fp32 is 2**23 + code
_MAGIC = tl.constexpr(8388608.0)
_TILE = tl.constexpr(128)  # K-columns per packed tile
# int4 without minima whose scale groups span whole tiles (>= 128 columns, or per channel): the dots take the
# exact integers code - zero and each tile's fp32 partial product is scaled once (SCALE_ON_ACC), so the operand
# is not rounded and the scale costs one multiply per output and tile instead of one per weight. False: the
# scale goes on the operand as for the other formats (for tuning).
SCALE_ON_ACC = True
_WORDS = tl.constexpr(16)  # int32 words per packed tile and row


@triton.jit
def _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, J: tl.constexpr, NF4: tl.constexpr,
           HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr):
    """Nibble plane J of a [BLOCK_N, 16] word tile (K-columns 128 tile + 16 J + c) dequantized in fp32:
    ``(code - zero) * scale`` (zero 8 when symmetric), ``code * scale + min`` or ``codebook[code] * scale``.
    SCALE_ON_ACC (int4 without minima, one group per tile): the exact integers ``code - zero``, unscaled."""
    code = (w >> (4 * J)) & 0xF
    if GROUP == -1:  # per channel: one group
        offs = rows
    else:
        # GROUP is a compile-time constant (32, 64 or a multiple of 128): the planes of one group share loads
        if GROUP < 128:
            group = tile * (128 // GROUP) + (J * 16) // GROUP
        else:
            group = tile // (GROUP // 128)
        offs = tl.cast(group, tl.int64) * stride_sg + rows
    if NF4:
        v = tl.load(cb_ptr + code)
    else:
        v = (code | _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC
        if HAS_ZERO:
            v = v - tl.load(z_base + offs, mask=n_ok, other=0).to(tl.float32)[:, None]
        elif not HAS_MIN:
            v = v - 8.0
    if SCALE_ON_ACC:
        return v
    scale = tl.load(s_base + offs, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_MIN:
        return v * scale + tl.load(m_base + offs, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    return v * scale


@triton.jit
def _natural_order(p0, p1, p2, p3, p4, p5, p6, p7):
    """8 planes [R, 16] (plane j: tile columns 16 j + c) as one [R, 128] tile in column order."""
    # [R, 16, 2, 2, 2] with plane index 4 t2 + 2 t1 + t0 -> [R, t2, t1, t0, c] -> column 16 j + c
    planes = tl.join(tl.join(tl.join(p0, p1), tl.join(p2, p3)), tl.join(tl.join(p4, p5), tl.join(p6, p7)))
    return tl.reshape(tl.permute(planes, (0, 4, 3, 2, 1)), (planes.shape[0], 128))


@triton.jit
def _dequant_tile(q_base, s_base, z_base, m_base, cb_ptr, rows, n_ok, tile, stride_qn, stride_sg,
                  NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr,
                  SCALE_ON_ACC: tl.constexpr, DTYPE: tl.constexpr):
    """Rows `rows` (int64; rows outside n_ok read as zero) of one expert's K-tile `tile` as a [BLOCK_N, 128]
    tile of DTYPE in K order: 16 words per row (four 128-bit loads), streamed once (evicted first)."""
    col = tl.arange(0, _WORDS)
    w = tl.load(q_base + rows[:, None] * stride_qn + tile * _WORDS + col[None, :], mask=n_ok[:, None], other=0,
                eviction_policy="evict_first")
    return _natural_order(
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 0, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 1, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 2, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 3, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 4, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 5, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 6, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 7, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE))


@triton.jit
def _tile_scales(s_base, rows, n_ok, tile, stride_sg, GROUP: tl.constexpr):
    """[BLOCK_N] fp32 scales of K-tile `tile` (one group spans it)."""
    if GROUP == -1:
        offs = rows
    else:
        offs = tl.cast(tile // (GROUP // 128), tl.int64) * stride_sg + rows
    return tl.load(s_base + offs, mask=n_ok, other=0.0).to(tl.float32)


@triton.jit
def _accumulate(a, w, acc, s_base, rows, n_ok, tile, stride_sg, GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ w^T for a dequantized [BLOCK_N, 128] tile w; SCALE_ON_ACC: w holds unscaled integers, and the
    tile's product is scaled here, per output column, before it is added."""
    if SCALE_ON_ACC:
        part = _dot(a, tl.trans(w), tl.zeros(acc.shape, dtype=tl.float32), PRECISION, UPCAST)
        return acc + part * _tile_scales(s_base, rows, n_ok, tile, stride_sg, GROUP)[None, :]
    return _dot(a, tl.trans(w), acc, PRECISION, UPCAST)


@triton.jit
def _swiglu_tile_q(a_ptrs, a_ok, q_base, s_base, z_base, m_base, cb_ptr, g_rows, u_rows, n_ok, K, stride_qn,
                   stride_sg, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, NF4: tl.constexpr, HAS_ZERO: tl.constexpr,
                   HAS_MIN: tl.constexpr, GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr, DTYPE: tl.constexpr):
    """`_swiglu_tile` on 4-bit weights: `a_ptrs` [BLOCK_M, 128] at K-column 0, gate / up rows `g_rows` / `u_rows`."""
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, _TILE)
    for tile in range(0, tl.cdiv(K, _TILE)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
        else:  # columns past K: x reads zero (the padded codes there need not dequantize to zero)
            a = tl.load(a_ptrs, mask=a_ok[:, None] & (offs_k + tile * _TILE < K)[None, :], other=0.0)
        # gate, then up: one dequantized tile live at a time
        g = _dequant_tile(q_base, s_base, z_base, m_base, cb_ptr, g_rows, n_ok, tile, stride_qn, stride_sg, NF4,
                          HAS_ZERO, HAS_MIN, GROUP, SCALE_ON_ACC, DTYPE)
        acc_g = _accumulate(a, g, acc_g, s_base, g_rows, n_ok, tile, stride_sg, GROUP, SCALE_ON_ACC, PRECISION,
                            UPCAST)
        u = _dequant_tile(q_base, s_base, z_base, m_base, cb_ptr, u_rows, n_ok, tile, stride_qn, stride_sg, NF4,
                          HAS_ZERO, HAS_MIN, GROUP, SCALE_ON_ACC, DTYPE)
        acc_u = _accumulate(a, u, acc_u, s_base, u_rows, n_ok, tile, stride_sg, GROUP, SCALE_ON_ACC, PRECISION,
                            UPCAST)
        a_ptrs += _TILE
    return acc_g / (1.0 + tl.exp(-acc_g)) * acc_u


@triton.jit
def _matmul_tile_q(a_ptrs, a_ok, q_base, s_base, z_base, m_base, cb_ptr, rows, n_ok, K, stride_qn, stride_sg,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   EVEN_K: tl.constexpr, NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
                   GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr, DTYPE: tl.constexpr):
    """`_matmul_tile` on 4-bit weights."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, _TILE)
    for tile in range(0, tl.cdiv(K, _TILE)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=a_ok[:, None] & (offs_k + tile * _TILE < K)[None, :], other=0.0)
        b = _dequant_tile(q_base, s_base, z_base, m_base, cb_ptr, rows, n_ok, tile, stride_qn, stride_sg, NF4,
                          HAS_ZERO, HAS_MIN, GROUP, SCALE_ON_ACC, DTYPE)
        acc = _accumulate(a, b, acc, s_base, rows, n_ok, tile, stride_sg, GROUP, SCALE_ON_ACC, PRECISION, UPCAST)
        a_ptrs += _TILE
    return acc


@triton.jit
def _quant_bases(w_ptr, s_ptr, z_ptr, m_ptr, e, stride_we, stride_se):
    """Expert e's packed words and group parameters (zeros and minima share the scales' layout)."""
    e64 = e.to(tl.int64)
    return w_ptr + e64 * stride_we, s_ptr + e64 * stride_se, z_ptr + e64 * stride_se, m_ptr + e64 * stride_se


@triton.jit
def _grouped_tile(pid, num_m_blocks, N, block_expert_ptr, sorted_ids_ptr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n, expert, rows, pairs) of a grouped-GEMM program; expert is -1 for unused blocks.

    Programs walk GROUP_M row blocks down one column of tiles before moving right, so a weight tile is
    read from HBM once and reused from L2 by the other row blocks of its expert.
    """
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    expert = tl.load(block_expert_ptr + pid_m)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows)  # in bounds for every block; unused blocks return before use
    return pid_n, expert, rows, pairs


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _gate_up_grouped_kernel(
    x_ptr, w_ptr, shared_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, inter_ptr, sorted_ids_ptr, block_expert_ptr,
    num_pairs, H, I, num_m_blocks, num_routed,
    stride_xt, stride_we, stride_wn, stride_sn, stride_se, stride_sg, stride_it,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, QUANT: tl.constexpr, NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
    GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr,
):
    """QUANT: 4-bit experts (BLOCK_K is then the packed tile, 128; w_ptr the packed words, s/z/m/cb_ptr their
    scales, zero points, minima and codebook; no shared expert)."""
    pid_n, expert, rows, pairs = _grouped_tile(tl.program_id(0), num_m_blocks, I, block_expert_ptr,
                                               sorted_ids_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    row_ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    if QUANT:
        q_base, s_base, z_base, m_base = _quant_bases(w_ptr, s_ptr, z_ptr, m_ptr, expert, stride_we, stride_se)
        g_rows = offs_n.to(tl.int64)
        act = _swiglu_tile_q(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :], row_ok, q_base, s_base, z_base,
                             m_base, cb_ptr, g_rows, g_rows + I, n_ok, H, stride_wn, stride_sg, PRECISION, UPCAST,
                             BLOCK_M, BLOCK_N, EVEN_K, NF4, HAS_ZERO, HAS_MIN, GROUP, SCALE_ON_ACC,
                             x_ptr.dtype.element_ty)
    else:
        w_base, stride_n = _expert_weights(w_ptr, shared_ptr, expert, num_routed, stride_we, stride_wn, stride_sn,
                                           HAS_SHARED)
        g_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_n + offs_k[:, None]
        act = _swiglu_tile(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :], row_ok,
                           g_ptrs, g_ptrs + I * stride_n, n_ok, H, PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    tl.store(inter_ptr + rows.to(tl.int64)[:, None] * stride_it + offs_n[None, :],
             act.to(inter_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _down_grouped_kernel(
    inter_ptr, w_ptr, shared_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
    num_pairs, H, I, num_m_blocks, num_routed,
    stride_it, stride_we, stride_wn, stride_sn, stride_se, stride_sg, stride_ot,
    HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, QUANT: tl.constexpr, NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
    GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr,
):
    pid_n, expert, rows, pairs = _grouped_tile(tl.program_id(0), num_m_blocks, H, block_expert_ptr,
                                               sorted_ids_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    row_ok = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_it + offs_k[None, :]
    if QUANT:
        q_base, s_base, z_base, m_base = _quant_bases(w_ptr, s_ptr, z_ptr, m_ptr, expert, stride_we, stride_se)
        acc = _matmul_tile_q(a_ptrs, row_ok, q_base, s_base, z_base, m_base, cb_ptr, offs_n.to(tl.int64), n_ok, I,
                             stride_wn, stride_sg, PRECISION, UPCAST, BLOCK_M, BLOCK_N, EVEN_K, NF4, HAS_ZERO,
                             HAS_MIN, GROUP, SCALE_ON_ACC, inter_ptr.dtype.element_ty)
    else:
        w_base, stride_n = _expert_weights(w_ptr, shared_ptr, expert, num_routed, stride_we, stride_wn, stride_sn,
                                           HAS_SHARED)
        acc = _matmul_tile(a_ptrs, row_ok, w_base + offs_n.to(tl.int64)[None, :] * stride_n + offs_k[:, None], n_ok, I,
                           PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    weight = tl.load(topk_w_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + offs_n[None, :],
             (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(pairs_ptr, ids_ptr, out_ptr, H, num_experts, stride_pt, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum over slots j, in slot order, of the weighted expert output of pair (t, j)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j)
        picked = (e >= 0) & (e < num_experts)
        row = tl.load(pairs_ptr + (t * TOP_K + j) * stride_pt + offs, mask=h_ok, other=0.0)
        acc += tl.where(picked, row.to(tl.float32), 0.0)  # rows of unpicked pairs were never written
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _decode_rows(ids_ptr, e, T, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, K_POW2: tl.constexpr):
    """For expert e: which tokens picked it, and the first slot where each did."""
    t = tl.arange(0, BLOCK_T)
    kcols = tl.arange(0, K_POW2)
    ids = tl.load(ids_ptr + t[:, None] * TOP_K + kcols[None, :],
                  mask=(t < T)[:, None] & (kcols < TOP_K)[None, :], other=-1)
    match = ids == e
    hit = tl.sum(match.to(tl.int32), axis=1) > 0
    slot = tl.min(tl.where(match, kcols[None, :], K_POW2), axis=1)
    return t, match, hit, slot


@triton.jit
def _first_pick(ids_ptr, s, num_pairs, num_experts, BLOCK_P: tl.constexpr):
    """(expert of pair s, whether pair s is the first pair to pick that valid expert)."""
    p = tl.arange(0, BLOCK_P)
    pair_ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1)
    e = tl.load(ids_ptr + s)
    earlier = tl.sum(((pair_ids == e) & (p < s)).to(tl.int32), axis=0)
    return e, (earlier == 0) & (e >= 0) & (e < num_experts)


@triton.jit(do_not_specialize=["T"])
def _gate_up_decode_kernel(
    x_ptr, w_ptr, shared_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, inter_ptr, ids_ptr,
    T, H, I, num_routed, num_experts,
    stride_xt, stride_we, stride_wn, stride_sn, stride_se, stride_sg, stride_it,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, K_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, QUANT: tl.constexpr, NF4: tl.constexpr,
    HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr,
):
    """QUANT: 4-bit experts, streamed once per selected expert and dequantized in registers (see the grouped kernel)."""
    e, first = _first_pick(ids_ptr, tl.program_id(0), T * TOP_K, num_experts, BLOCK_P)
    if first:
        t, match, hit, slot = _decode_rows(ids_ptr, e, T, TOP_K, BLOCK_T, K_POW2)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + t.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
        if QUANT:
            q_base, s_base, z_base, m_base = _quant_bases(w_ptr, s_ptr, z_ptr, m_ptr, e, stride_we, stride_se)
            g_rows = offs_n.to(tl.int64)
            act = _swiglu_tile_q(a_ptrs, t < T, q_base, s_base, z_base, m_base, cb_ptr, g_rows, g_rows + I, n_ok, H,
                                 stride_wn, stride_sg, PRECISION, UPCAST, BLOCK_T, BLOCK_N, EVEN_K, NF4, HAS_ZERO,
                                 HAS_MIN, GROUP, SCALE_ON_ACC, x_ptr.dtype.element_ty)
        else:
            w_base, stride_n = _expert_weights(w_ptr, shared_ptr, e, num_routed, stride_we, stride_wn, stride_sn,
                                               HAS_SHARED)
            g_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_n + offs_k[:, None]
            act = _swiglu_tile(a_ptrs, t < T, g_ptrs, g_ptrs + I * stride_n, n_ok, H, PRECISION, UPCAST, BLOCK_T,
                               BLOCK_N, BLOCK_K, EVEN_K)
        rows = (t * TOP_K + slot).to(tl.int64)
        tl.store(inter_ptr + rows[:, None] * stride_it + offs_n[None, :],
                 act.to(inter_ptr.dtype.element_ty), mask=hit[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _down_decode_kernel(
    inter_ptr, w_ptr, shared_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, pair_out_ptr, ids_ptr, topk_w_ptr,
    T, H, I, num_routed, num_experts,
    stride_it, stride_we, stride_wn, stride_sn, stride_se, stride_sg, stride_pt,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, K_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, QUANT: tl.constexpr, NF4: tl.constexpr,
    HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr,
):
    """Down projection of one selected expert for one column block, written weighted to each slot that picked it."""
    e, first = _first_pick(ids_ptr, tl.program_id(0), T * TOP_K, num_experts, BLOCK_P)
    if first:
        t, match, hit, slot = _decode_rows(ids_ptr, e, T, TOP_K, BLOCK_T, K_POW2)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        offs_k = tl.arange(0, BLOCK_K)
        rows = (t * TOP_K + slot).to(tl.int64)
        a_ptrs = inter_ptr + rows[:, None] * stride_it + offs_k[None, :]
        if QUANT:
            q_base, s_base, z_base, m_base = _quant_bases(w_ptr, s_ptr, z_ptr, m_ptr, e, stride_we, stride_se)
            acc = _matmul_tile_q(a_ptrs, hit, q_base, s_base, z_base, m_base, cb_ptr, offs_n.to(tl.int64), n_ok, I,
                                 stride_wn, stride_sg, PRECISION, UPCAST, BLOCK_T, BLOCK_N, EVEN_K, NF4, HAS_ZERO,
                                 HAS_MIN, GROUP, SCALE_ON_ACC, inter_ptr.dtype.element_ty)
        else:
            w_base, stride_n = _expert_weights(w_ptr, shared_ptr, e, num_routed, stride_we, stride_wn, stride_sn,
                                               HAS_SHARED)
            acc = _matmul_tile(a_ptrs, hit, w_base + offs_n.to(tl.int64)[None, :] * stride_n + offs_k[:, None], n_ok, I,
                               PRECISION, UPCAST, BLOCK_T, BLOCK_N, BLOCK_K, EVEN_K)
        kcols = tl.arange(0, K_POW2)
        topk_w = tl.load(topk_w_ptr + t[:, None] * TOP_K + kcols[None, :], mask=match, other=0.0).to(tl.float32)
        for j in tl.static_range(TOP_K):  # a token that names e in several slots: each slot its own weight
            w_j = tl.sum(tl.where(kcols[None, :] == j, topk_w, 0.0), axis=1)
            picked_j = tl.sum((match & (kcols[None, :] == j)).to(tl.int32), axis=1) > 0
            tl.store(pair_out_ptr + (t * TOP_K + j).to(tl.int64)[:, None] * stride_pt + offs_n[None, :],
                     (acc * w_j[:, None]).to(pair_out_ptr.dtype.element_ty), mask=picked_j[:, None] & n_ok[None, :])


# 4-bit decode GEMVs (T <= GEMV_MAX_TOKENS): one program per (token, slot) pair and block of output rows, no
# tensor cores. At a few tokens a tl.dot pads them to 16 rows and needs the dequantized tile in the MMA's operand
# layout (a shared-memory round trip per K-tile); here the K loop keeps a [BLOCK_N, TILES, 16] tile of words in
# flight and each int4 weight costs a LOP3, an FADD and an FFMA (`_int4_plane`): 4.7 (down) and 5.3 (gate/up)
# instructions per weight in the K loop's SASS for int4 g128 (sm_90).
# Pairs of one expert each stream its weights (from L2 after the first): worth it only while pairs are few.
GEMV_MAX_TOKENS = 4


@triton.jit
def _gemv_x_plane(x_row, tile, col, K, J: tl.constexpr, EVEN_K: tl.constexpr):
    """x at K-columns 128 tile + 16 J + c as fp32 [1, TILES, 16] (zero past K), broadcast over the rows.
    EVEN_K: every column of every loop step is below K (K a multiple of 128 TILES), no mask."""
    k = tile[None, :, None] * 128 + J * 16 + col[None, None, :]
    if EVEN_K:
        return tl.load(x_row + k).to(tl.float32)
    return tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)


# (word & (0xF << 4 j)) | 2**23 bits: LOP3 with truth table 0xEA = (a & b) | c
_LOP3_NIBBLE_0 = tl.constexpr("lop3.b32 $0, $1, 0x000F, 0x4B000000, 0xEA;")
_LOP3_NIBBLE_1 = tl.constexpr("lop3.b32 $0, $1, 0x00F0, 0x4B000000, 0xEA;")
_LOP3_NIBBLE_2 = tl.constexpr("lop3.b32 $0, $1, 0x0F00, 0x4B000000, 0xEA;")
_LOP3_NIBBLE_3 = tl.constexpr("lop3.b32 $0, $1, 0xF000, 0x4B000000, 0xEA;")


@triton.jit
def _int4_plane(half, j: tl.constexpr, bias, EMULATE: tl.constexpr):
    """(code - zero) * 16**j of nibble j (0-3) of each 16-bit half-word: the nibble masked in place under the bits
    of 2**23 (code * 16**j < 2**23, so the float is exactly 2**23 + code * 16**j), minus `bias` = 2**23 +
    zero * 16**j. No shift: the caller scales the plane's sum by 16**-j (exact). The mask-and-or is one LOP3 in
    inline PTX (with two constants LLVM emits two); EMULATE (the interpreter, which cannot run PTX) does the same
    in Triton operations."""
    if EMULATE:
        bits = (half & (0xF << (4 * j))) | _MAGIC_BITS
    else:
        if j == 0:
            asm: tl.constexpr = _LOP3_NIBBLE_0
        elif j == 1:
            asm: tl.constexpr = _LOP3_NIBBLE_1
        elif j == 2:
            asm: tl.constexpr = _LOP3_NIBBLE_2
        else:
            asm: tl.constexpr = _LOP3_NIBBLE_3
        bits = tl.inline_asm_elementwise(asm, "=r,r", [half], dtype=tl.uint32, is_pure=True, pack=1)
    return bits.to(tl.float32, bitcast=True) - bias


@triton.jit
def _gemv_plane(words, high, cb_ptr, zero, J: tl.constexpr, NF4: tl.constexpr, EMULATE: tl.constexpr):
    """Plane J of uint32 words: codebook[code] (NF4), else (code - zero) * 16**(J % 4) (`_int4_plane`)."""
    if NF4:
        return tl.load(cb_ptr + ((words >> (4 * J)) & 0xF))
    return _int4_plane(high if J >= 4 else words, J % 4, _MAGIC + zero * (16 ** (J % 4)), EMULATE)


@triton.jit
def _gemv_chunk(w, x_row, tile, live, col, rows, n_ok, K, s_base, z_base, m_base, cb_ptr, stride_sg,
                NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr,
                EVEN_K: tl.constexpr, EMULATE: tl.constexpr):
    """sum over the 8 nibble planes of [BLOCK_N, TILES, 16] words `w` times x, per word (reduced by the caller):
    each scale group's planes summed unscaled, then scaled (and its minimum times the group's x sum added).
    Plane J is nibble J % 4 of the word's low (J < 4) or high half; planes with the same J % 4 share one sum,
    scaled by 16**-(J % 4) once. Per channel (GROUP -1) the scale and zero are the caller's, after the K loop."""
    PLANES: tl.constexpr = 8 if (GROUP == -1 or GROUP >= 128) else GROUP // 16
    words = w.to(tl.uint32, bitcast=True)
    high = words >> 16
    part = tl.zeros(w.shape, dtype=tl.float32)
    for g in tl.static_range(8 // PLANES):
        if GROUP == -1:
            offs = rows[:, None, None]
        elif GROUP >= 128:
            offs = (tile // (GROUP // 128))[None, :, None].to(tl.int64) * stride_sg + rows[:, None, None]
        else:
            offs = (tile * (128 // GROUP) + g)[None, :, None].to(tl.int64) * stride_sg + rows[:, None, None]
        ok = n_ok[:, None, None] & live[None, :, None]
        if NF4 or HAS_MIN or (HAS_ZERO and GROUP == -1):
            zero = 0.0  # NF4 looks codes up; minima add min * sum(x); per-channel zeros: the caller
        elif HAS_ZERO:
            zero = tl.load(z_base + offs, mask=ok, other=0).to(tl.float32)
        else:
            zero = 8.0
        sub = tl.zeros(w.shape, dtype=tl.float32)
        x_sum = tl.zeros([1, tile.shape[0], 16], dtype=tl.float32)
        for jj in tl.static_range(PLANES if PLANES < 4 else 4):  # the distinct J % 4 of the group
            same = tl.zeros(w.shape, dtype=tl.float32)
            for hh in tl.static_range(2 if PLANES == 8 else 1):  # both halves when the group spans the word
                # plane J = g * PLANES + 4 hh + jj (g is 0 when PLANES is 8, hh is 0 otherwise)
                x = _gemv_x_plane(x_row, tile, col, K, g * PLANES + 4 * hh + jj, EVEN_K)
                same += _gemv_plane(words, high, cb_ptr, zero, g * PLANES + 4 * hh + jj, NF4, EMULATE) * x
                if HAS_MIN:
                    x_sum += x
            sub += same if NF4 else same * (0.0625 ** ((g * PLANES + jj) % 4))
        if GROUP == -1:
            part += sub
        else:
            sub = sub * tl.load(s_base + offs, mask=ok, other=0.0).to(tl.float32)
            if HAS_MIN:  # min * (sum of the group's x), spread over the words: each word adds its own columns'
                sub += tl.load(m_base + offs, mask=ok, other=0.0).to(tl.float32) * x_sum
            part += sub
    return part


@triton.jit
def _gemv_rows(x_row, q_base, s_base, z_base, m_base, cb_ptr, rows, rows_b, n_ok, K, stride_qn, stride_sg,
               BLOCK_N: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr, TWO: tl.constexpr,
               NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr,
               EVEN_K: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 [BLOCK_N] dot products of x_row with weight rows `rows` over all of K; TWO: also rows `rows_b` (the up
    rows of a gate/up pair, in the same loop so that both tiles are in flight together)."""
    num_tiles = tl.cdiv(K, 128)
    tile_ar = tl.arange(0, TILES)
    col = tl.arange(0, _WORDS)
    acc = tl.zeros([BLOCK_N, TILES, _WORDS], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N, TILES, _WORDS], dtype=tl.float32)
    w_ptrs = q_base + rows[:, None, None] * stride_qn + col[None, None, :]
    w_ptrs_b = q_base + rows_b[:, None, None] * stride_qn + col[None, None, :]
    for it in tl.range(0, num_tiles, TILES, num_stages=STAGES):
        tile = it + tile_ar
        live = tile < num_tiles
        mask = n_ok[:, None, None] & live[None, :, None]
        offs = tile[None, :, None] * _WORDS
        w = tl.load(w_ptrs + offs, mask=mask, other=0, eviction_policy="evict_first")
        if TWO:
            w_b = tl.load(w_ptrs_b + offs, mask=mask, other=0, eviction_policy="evict_first")
        acc += _gemv_chunk(w, x_row, tile, live, col, rows, n_ok, K, s_base, z_base, m_base, cb_ptr, stride_sg,
                           NF4, HAS_ZERO, HAS_MIN, GROUP, EVEN_K, EMULATE)
        if TWO:
            acc_b += _gemv_chunk(w_b, x_row, tile, live, col, rows_b, n_ok, K, s_base, z_base, m_base, cb_ptr,
                                 stride_sg, NF4, HAS_ZERO, HAS_MIN, GROUP, EVEN_K, EMULATE)
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    out_b = tl.sum(tl.sum(acc_b, axis=2), axis=1)
    if GROUP == -1:  # per channel: (sum code x - zero sum x) * scale, from the parameters of each row
        if HAS_ZERO:
            x_total = 0.0
            for it in range(0, num_tiles):
                x_total += tl.sum(tl.load(x_row + it * 128 + tl.arange(0, 128), mask=it * 128 + tl.arange(0, 128) < K,
                                          other=0.0).to(tl.float32), axis=0)
            out -= tl.load(z_base + rows, mask=n_ok, other=0).to(tl.float32) * x_total
            out_b -= tl.load(z_base + rows_b, mask=n_ok, other=0).to(tl.float32) * x_total
        out *= tl.load(s_base + rows, mask=n_ok, other=0.0).to(tl.float32)
        out_b *= tl.load(s_base + rows_b, mask=n_ok, other=0.0).to(tl.float32)
    return out, out_b


@triton.jit(do_not_specialize=["T"])
def _gate_up_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, inter_ptr, ids_ptr,
    T, H, I, num_experts, stride_xt, stride_we, stride_wn, stride_se, stride_sg, stride_it,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
    NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """inter[p, n] = silu(gate) * up of pair p's token through its expert, for a block of n (4-bit experts)."""
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p)
    if (e >= 0) & (e < num_experts):  # other ids select nothing; the combine skips their pairs
        q_base, s_base, z_base, m_base = _quant_bases(w_ptr, s_ptr, z_ptr, m_ptr, e, stride_we, stride_se)
        rows = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        n_ok = rows < I
        x_row = x_ptr + (p // TOP_K).to(tl.int64) * stride_xt
        gate, up = _gemv_rows(x_row, q_base, s_base, z_base, m_base, cb_ptr, rows, rows + I, n_ok, H, stride_wn,
                              stride_sg, BLOCK_N, TILES, STAGES, True, NF4, HAS_ZERO, HAS_MIN, GROUP, EVEN_K,
                              EMULATE)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(inter_ptr + p.to(tl.int64) * stride_it + rows, act.to(inter_ptr.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["T"])
def _down_gemv_kernel(
    inter_ptr, w_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, pair_out_ptr, ids_ptr, topk_w_ptr,
    T, H, I, num_experts, stride_it, stride_we, stride_wn, stride_se, stride_sg, stride_pt,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
    NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """pair_out[p, n] = topk_weight[p] * (down projection of inter[p]), for a block of n (4-bit experts)."""
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p)
    if (e >= 0) & (e < num_experts):
        q_base, s_base, z_base, m_base = _quant_bases(w_ptr, s_ptr, z_ptr, m_ptr, e, stride_we, stride_se)
        rows = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        n_ok = rows < H
        acc, _ = _gemv_rows(inter_ptr + p.to(tl.int64) * stride_it, q_base, s_base, z_base, m_base, cb_ptr, rows,
                            rows, n_ok, I, stride_wn, stride_sg, BLOCK_N, TILES, STAGES, False, NF4, HAS_ZERO,
                            HAS_MIN, GROUP, EVEN_K, EMULATE)
        acc *= tl.load(topk_w_ptr + p).to(tl.float32)
        tl.store(pair_out_ptr + p.to(tl.int64) * stride_pt + rows, acc.to(pair_out_ptr.dtype.element_ty), mask=n_ok)


# ----------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------


def config_path(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, device_name: str) -> Path:
    """configs/E=..,H=..,I=..,dtype=..,device=<gpu>.json: the layer's shape, then the GPU's name in lower case
    with dashes ("NVIDIA H200" -> nvidia-h200), so a table applies only to the GPU it was measured on."""
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    dtype_name = str(dtype).removeprefix("torch.")
    return CONFIG_DIR / f"E={num_experts},H={hidden},I={intermediate},dtype={dtype_name},device={slug}.json"


@functools.cache
def _tuned_configs(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                   device_name: str) -> dict[int, dict]:
    """{token count: config} of the layer's table for this GPU ({} without one); the file also holds its
    "device" and "measured" (provenance)."""
    path = config_path(num_experts, hidden, intermediate, dtype, device_name)
    if not path.exists():
        return {}
    return {int(tokens): config for tokens, config in json.loads(path.read_text())["tokens"].items()}


@functools.cache
def _device_name(device: torch.device) -> str | None:
    """The GPU's name; None for CPU tensors (the Triton interpreter), which take the heuristic silently."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


@functools.cache
def _note_heuristic(device_name: str, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                    decode: bool) -> None:
    """Say once per GPU, layer shape and side of the decode cut that no tuned config exists."""
    path = config_path(num_experts, hidden, intermediate, dtype, device_name)
    logger.warning("moe-dispatch: no tuned %s config for E=%d, H=%d, I=%d, %s on %s (%s configs/%s); using the "
                   "heuristic", "decode" if decode else "grouped", num_experts, hidden, intermediate, dtype,
                   device_name, "in" if path.exists() else "no", path.name)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: keep grids small


def _pow2_at_most(n: int, cap: int) -> int:
    """The smallest power of two >= n, at least 16 (tl.dot's minimum) and at most cap."""
    return max(16, min(cap, triton.next_power_of_2(n)))


def default_config(tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int,
                   device: torch.device, quantized: bool = False) -> dict:
    """Heuristic block sizes when no tuned config exists for the shape (`quantized`: 4-bit experts, whose
    BLOCK_K is the packed tile; `_for_weights`)."""
    if quantized and tokens <= GEMV_MAX_TOKENS:
        # The best of a sweep on the H200 (BLOCK_N 8-32, TILES 2-4, 1 or 3 stages; Mixtral, DeepSeek-V3, Qwen3-30B
        # at T=1, docs/design/moe-dispatch.md): every config within ~6 % of these, so the kernels are bound by
        # their instructions, not by the block sizes
        return {"gate_up": {"BLOCK_N": 8, "BLOCK_K": 128, "TILES": 4, "num_warps": 4, "num_stages": 1},
                "down": {"BLOCK_N": 16, "BLOCK_K": 128, "TILES": 4, "num_warps": 4, "num_stages": 1}}
    if quantized:
        config = _for_weights(default_config(tokens, num_experts, hidden, intermediate, top_k, device), True)
        if "BLOCK_M" in config:
            # (BLOCK_N, num_warps, num_stages) of the gate/up and the down kernel per BLOCK_M: no register spills
            # in an sm_90 compile on the CPU (triton 3.9) for int4 (symmetric, zero points, minima) and NF4; not
            # yet measured on a GPU
            up, down = {16: ((64, 4, 3), (64, 4, 3)), 32: ((64, 4, 3), (64, 4, 3)), 64: ((128, 8, 3), (128, 8, 3)),
                        128: ((32, 8, 3), (64, 8, 3))}[config["BLOCK_M"]]
            for key, rows, (n, warps, stages) in (("gate_up", intermediate, up), ("down", hidden, down)):
                config[key] = {**config[key], "BLOCK_N": _pow2_at_most(rows, n), "num_warps": warps,
                               "num_stages": stages}
        return config
    sms = _sm_count(device)
    if tokens <= DECODE_MAX_TOKENS:
        active = min(num_experts, tokens * top_k)
        # enough column blocks that each SM streams several weight slabs at once
        n_up = next((n for n in (64, 32) if active * triton.cdiv(intermediate, n) >= 4 * sms), 16)
        n_down = next((n for n in (64, 32) if active * triton.cdiv(hidden, n) >= 4 * sms), 16)
        return {
            "gate_up": {"BLOCK_N": _pow2_at_most(intermediate, n_up), "BLOCK_K": _pow2_at_most(hidden, 256),
                        "num_warps": 4, "num_stages": 4},
            "down": {"BLOCK_N": _pow2_at_most(hidden, n_down), "BLOCK_K": _pow2_at_most(intermediate, 256),
                     "num_warps": 4, "num_stages": 4},
        }
    per_expert = tokens * top_k / num_experts
    block_m = next((m for m in (16, 32, 64) if per_expert <= m), 128)
    # (BLOCK_N, BLOCK_K, num_warps, num_stages) per BLOCK_M: the winners of the H200 tuning (hubtools/bench/moe_dispatch_tune.py)
    up_n, up_k, up_warps, up_stages, down_n, down_k, down_warps, down_stages = {
        16: (64, 128, 4, 4, 64, 128, 4, 4), 32: (64, 128, 4, 4, 64, 128, 4, 4),
        64: (128, 64, 4, 4, 128, 64, 4, 4), 128: (128, 64, 8, 4, 256, 64, 8, 3),
    }[block_m]
    return {
        "BLOCK_M": block_m,
        "gate_up": {"BLOCK_N": _pow2_at_most(intermediate, up_n), "BLOCK_K": _pow2_at_most(hidden, up_k),
                    "GROUP_M": 8, "num_warps": up_warps, "num_stages": up_stages},
        "down": {"BLOCK_N": _pow2_at_most(hidden, down_n), "BLOCK_K": _pow2_at_most(intermediate, down_k),
                 "GROUP_M": 8, "num_warps": down_warps, "num_stages": down_stages},
    }


def get_config(tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int,
               dtype: torch.dtype, device: torch.device) -> dict:
    """The tuned config of this GPU's table at the nearest token count on the same side of the decode cut,
    else the heuristic (said once in a warning on a GPU)."""
    decode = tokens <= DECODE_MAX_TOKENS
    name = _device_name(device)
    table = _tuned_configs(num_experts, hidden, intermediate, dtype, name) if name else {}
    tuned = {t: c for t, c in table.items() if (t <= DECODE_MAX_TOKENS) == decode}
    if tuned:
        return tuned[min(tuned, key=lambda t: (abs(t - tokens), t))]
    if name:
        _note_heuristic(name, num_experts, hidden, intermediate, dtype, decode)
    return default_config(tokens, num_experts, hidden, intermediate, top_k, device)


def _for_weights(config: dict, quantized: bool) -> dict:
    """4-bit experts step through K one packed tile (128 columns) at a time, and dequantize a [BLOCK_N, 128] tile
    in registers: BLOCK_K is 128 and BLOCK_N at most 128."""
    return {key: {**value, "BLOCK_K": 128, "BLOCK_N": min(128, value["BLOCK_N"])} if isinstance(value, dict)
            else value for key, value in config.items()}


def _for_dtype(config: dict, dtype: torch.dtype) -> dict:
    """Configs are sized for 16-bit operands; 32-bit ones get half the BLOCK_K: the same shared memory per stage."""
    if dtype.itemsize != 4:
        return config
    return {key: {**value, "BLOCK_K": max(16, value["BLOCK_K"] // 2)} if isinstance(value, dict) else value
            for key, value in config.items()}


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands: three tf32 passes give fp32 accuracy on tensor cores; 16-bit operands ignore this
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _upcast_dots(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


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
    chunk's expert histogram is written to it (the fused path's input to the sort).
    """
    fused = hidden_states is not None
    T, E = (hidden_states.shape[0], router_weight.shape[0]) if fused else logits.shape
    out_k = top_k + int(shared_slot)
    weights = torch.empty(T, out_k, dtype=torch.float32, device=(hidden_states if fused else logits).device)
    ids = torch.empty(T, out_k, dtype=torch.int32, device=weights.device)
    if T == 0:
        return weights, ids
    # the histogram is per CHUNK_TOKENS chunk; otherwise no more rows than tokens (decode: one row, one warp)
    block_t = CHUNK_TOKENS if hist is not None else min(16, triton.next_power_of_2(T))
    block_e = max(16, triton.next_power_of_2(E))
    dummy = weights
    with _device_guard(weights):
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
            UPCAST=fused and _upcast_dots(router_weight.dtype),
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


def _gemv_format(fmt: dict) -> dict:
    """The format constexprs the GEMV kernels take (they scale per group themselves: no SCALE_ON_ACC)."""
    return {**{key: fmt[key] for key in ("NF4", "HAS_ZERO", "HAS_MIN", "GROUP")},
            "EMULATE": os.environ.get("TRITON_INTERPRET") == "1"}


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
    if config is None:  # the tuned tables were measured with 16-bit weights: 4-bit experts take the heuristic
        config = (default_config(T, num_routed, H, intermediate, top_k, hidden_states.device, quantized=True) if quant
                  else get_config(T, num_routed, H, intermediate, top_k, hidden_states.dtype, hidden_states.device))
    config = _for_weights(config, quant) if quant else _for_dtype(config, hidden_states.dtype)
    up, down = config["gate_up"], config["down"]
    common = dict(HAS_SHARED=has_shared, PRECISION=_precision(hidden_states.dtype),
                  UPCAST=_upcast_dots(hidden_states.dtype))
    shared_gu = shared_gate_up if has_shared else _words(w_gate_up)
    shared_dn = shared_down if has_shared else _words(w_down)
    gu_ptrs, gu_strides, gu_format = _weight_args(w_gate_up)
    dn_ptrs, dn_strides, dn_format = _weight_args(w_down)
    num_pairs = T * top_k
    device = hidden_states.device
    pair_out = torch.empty(num_pairs, H, dtype=hidden_states.dtype, device=device)
    with _device_guard(hidden_states):
        if quant and T <= GEMV_MAX_TOKENS:
            # fp32 intermediate: the down GEMV's x then needs no conversion per weight (each thread holds one row
            # of its words, so an x conversion is not shared between rows)
            inter = torch.empty(num_pairs, intermediate, dtype=torch.float32, device=device)
            _gate_up_gemv_kernel[(num_pairs, triton.cdiv(intermediate, up["BLOCK_N"]))](
                hidden_states, _words(w_gate_up), *gu_ptrs, inter, topk_ids,
                T, H, intermediate, num_routed, hidden_states.stride(0), *gu_strides, inter.stride(0),
                TOP_K=top_k, BLOCK_N=up["BLOCK_N"], TILES=up["TILES"], STAGES=up["num_stages"],
                EVEN_K=H % (128 * up["TILES"]) == 0, num_warps=up["num_warps"], **_gemv_format(gu_format),
            )
            _down_gemv_kernel[(num_pairs, triton.cdiv(H, down["BLOCK_N"]))](
                inter, _words(w_down), *dn_ptrs, pair_out, topk_ids, topk_weights,
                T, H, intermediate, num_routed, inter.stride(0), *dn_strides, pair_out.stride(0),
                BLOCK_N=down["BLOCK_N"], TILES=down["TILES"], STAGES=down["num_stages"],
                EVEN_K=intermediate % (128 * down["TILES"]) == 0, num_warps=down["num_warps"],
                **_gemv_format(dn_format),
            )
        elif T <= DECODE_MAX_TOKENS:
            common.update(TOP_K=top_k, BLOCK_T=16, BLOCK_P=triton.next_power_of_2(num_pairs),
                          K_POW2=triton.next_power_of_2(top_k))
            inter = torch.empty(num_pairs, intermediate, dtype=hidden_states.dtype, device=device)
            _gate_up_decode_kernel[(num_pairs, triton.cdiv(intermediate, up["BLOCK_N"]))](
                hidden_states, _words(w_gate_up), shared_gu, *gu_ptrs, inter, topk_ids,
                T, H, intermediate, num_routed, num_experts,
                hidden_states.stride(0), *gu_strides[:2], shared_gu.stride(-2), *gu_strides[2:], inter.stride(0),
                BLOCK_N=up["BLOCK_N"], BLOCK_K=up["BLOCK_K"], EVEN_K=H % up["BLOCK_K"] == 0,
                num_warps=up["num_warps"], num_stages=up["num_stages"], **common, **gu_format,
            )
            _down_decode_kernel[(num_pairs, triton.cdiv(H, down["BLOCK_N"]))](
                inter, _words(w_down), shared_dn, *dn_ptrs, pair_out, topk_ids, topk_weights,
                T, H, intermediate, num_routed, num_experts,
                inter.stride(0), *dn_strides[:2], shared_dn.stride(-2), *dn_strides[2:], pair_out.stride(0),
                BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"], EVEN_K=intermediate % down["BLOCK_K"] == 0,
                num_warps=down["num_warps"], num_stages=down["num_stages"], **common, **dn_format,
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
            _gate_up_grouped_kernel[(max_blocks * triton.cdiv(intermediate, up["BLOCK_N"]),)](
                hidden_states, _words(w_gate_up), shared_gu, *gu_ptrs, inter, sorted_ids, block_expert,
                num_pairs, H, intermediate, max_blocks, num_routed,
                hidden_states.stride(0), *gu_strides[:2], shared_gu.stride(-2), *gu_strides[2:], inter.stride(0),
                TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=up["BLOCK_N"], BLOCK_K=up["BLOCK_K"], GROUP_M=up["GROUP_M"],
                EVEN_K=H % up["BLOCK_K"] == 0, num_warps=up["num_warps"], num_stages=up["num_stages"], **common,
                **gu_format,
            )
            _down_grouped_kernel[(max_blocks * triton.cdiv(H, down["BLOCK_N"]),)](
                inter, _words(w_down), shared_dn, *dn_ptrs, pair_out, sorted_ids, block_expert, topk_weights,
                num_pairs, H, intermediate, max_blocks, num_routed,
                inter.stride(0), *dn_strides[:2], shared_dn.stride(-2), *dn_strides[2:], pair_out.stride(0),
                BLOCK_M=block_m, BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"], GROUP_M=down["GROUP_M"],
                EVEN_K=intermediate % down["BLOCK_K"] == 0, num_warps=down["num_warps"],
                num_stages=down["num_stages"], **common, **dn_format,
            )
        block_h = min(1024, triton.next_power_of_2(H))
        _combine_kernel[(T, triton.cdiv(H, block_h))](
            pair_out, topk_ids, out, H, num_experts, pair_out.stride(0), out.stride(0),
            TOP_K=top_k, BLOCK_H=block_h, num_warps=4,
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
    if T <= DECODE_MAX_TOKENS:
        # a GEMV over all router rows needs the whole GPU: cuBLAS, then the routing kernel
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
