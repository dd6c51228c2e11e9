"""Routing kernels: the router GEMV at a few tokens, top-k of the router logits (the router GEMM fused at
large T), the per-chunk expert histogram and the sort of (token, slot) pairs by expert."""

import triton
import triton.language as tl

from .tiles import _dot, _pdl_launch_dependents, _pdl_wait


# ----------------------------------------------------------------------------------------------------
# Router GEMV (decode)
# ----------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T"])
def _router_gemv_kernel(x_ptr, w_ptr, logits_ptr, T, E, H, stride_xt, stride_we,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Router logits of a few tokens spread over the GPU: program e sums x[t] * w[rows] over all of H for its
    BLOCK_E router rows (fp32 products kept per column, one reduction after the loop) and stores them rounded to
    the router's dtype, as F.linear does, into logits [T, E]. PDL: x is the previous kernel's output; the routing
    kernel may launch at once (one program, waiting for this grid)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok = rows < E
    tokens = tl.arange(0, BLOCK_T)
    token_ok = tokens < T
    _pdl_wait(PDL)
    _pdl_launch_dependents(PDL)
    acc = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        col_ok = cols < H
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + cols[None, :], mask=token_ok[:, None] & col_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_we + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    logits = tl.sum(acc, axis=2).to(w_ptr.dtype.element_ty)
    tl.store(logits_ptr + tokens[:, None] * E + rows[None, :], logits, mask=token_ok[:, None] & row_ok[None, :])


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
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Top-k routing of logits loaded from logits_ptr [T, E] (PDL: launched as `_router_gemv_kernel`'s dependent)
    or computed here (FUSED_LOGITS)."""
    _pdl_wait(PDL)
    _pdl_launch_dependents(PDL)
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
        # round like F.linear in the router weight's dtype, so the routing of every path agrees
        logits = logits.to(router_w_ptr.dtype.element_ty).to(tl.float32)
    else:
        logits = tl.load(logits_ptr + rows64[:, None] * stride_lt + cols[None, :],
                         mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)

    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        row_max = tl.max(tl.where(col_ok[None, :], logits, float("-inf")), axis=1)
        p = tl.where(col_ok[None, :], tl.exp(logits - row_max[:, None]), 0.0)
        row_sum = tl.sum(p, axis=1)
        scores = p / row_sum[:, None]
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
            first, best = tl.max(in_group, axis=1, return_indices=True, return_indices_tie_break_left=True)
            second = tl.max(tl.where(cols[None, :] == best[:, None], float("-inf"), in_group), axis=1)
            group_scores = tl.where(gcols[None, :] == g, (first + second)[:, None], group_scores)
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
        if FUSED_LOGITS:
            top_w = tl.where(kcols[None, :] == j, tl.sum(tl.where(picked, scores, 0.0), axis=1)[:, None], top_w)
        top_i = tl.where(kcols[None, :] == j, best.to(tl.int32)[:, None], top_i)
        choice = tl.where(picked, float("-inf"), choice)
    if not FUSED_LOGITS:
        # the chosen logits again from memory (cached) and their scores by the same arithmetic: no reduction per
        # slot, whose shuffles bound this kernel at a few tokens
        slot_ok = row_ok[:, None] & (kcols < TOP_K)[None, :]
        chosen = tl.load(logits_ptr + rows64[:, None] * stride_lt + top_i, mask=slot_ok, other=0.0).to(tl.float32)
        if SIGMOID:
            top_w = tl.sigmoid(chosen)
        else:
            top_w = tl.exp(chosen - row_max[:, None]) / row_sum[:, None]
        top_w = tl.where(slot_ok, top_w, 0.0)
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
