"""The 4-bit experts' GEMVs on tensor cores (`_gate_up_mma_kernel`, `_down_mma_kernel`): w4a16's mma GEMV loop
(`mma_gemv._mma_acc`, the module byte for byte) over one (token, slot) pair's expert; in the gate/up GEMV a
program's first half of rows is the gate's and its second half the same rows of up, so that each thread holds both
of a row's sums.

The packed-fp16 GEMV issues 2.7 instructions a weight on Mixtral's gate/up (sm_90a SASS, docs/design/
moe-dispatch.md, session 40): the product with x, the halves' sum, the widening and the scale of each word. Here the
MMA takes those; what is left a weight is its dequantization into the A operand (20 instructions for 16 weights)."""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .mma_gemv import _mma_acc


@gluon.jit
def _store_token_column(row_ptr, values, off_n, limit):
    """Column 0 of ``values [rows, 8]`` (the pair's token; the MMA's other 7 columns are padding) at
    ``row_ptr[off_n + r]`` for the rows below `limit`, in the row's dtype."""
    ROWS: gl.constexpr = values.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [gl.num_warps(), 1], [0, 1])
    n = off_n + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    m = gl.arange(0, 8, layout=gl.SliceLayout(0, layout))
    gl.store(row_ptr + n[:, None] + m[None, :] * 0, gl.convert_layout(values, layout).to(row_ptr.dtype.element_ty),
             mask=(n < limit)[:, None] & (m == 0)[None, :])


@gluon.jit
def _zero_counts(counts_ptr, p, count_blocks, TOP_K: gl.constexpr):
    """The first program of each token (its first pair, first row block) zeroes the token's `count_blocks` arrival
    counts of the packed down GEMV's fold (`gemv._fold_combine`), as `gemv._zero_counts` does in the packed gate/up
    GEMV: the down GEMV touches them only after its wait for this grid."""
    if (p % TOP_K == 0) & (gl.program_id(1) == 0):
        WIDTH: gl.constexpr = 32 * gl.num_warps()
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        base = counts_ptr + (p // TOP_K).to(gl.int64) * count_blocks
        for i in range(0, count_blocks, WIDTH):
            offs = i + gl.arange(0, WIDTH, layout=layout)
            gl.store(base + offs, gl.zeros([WIDTH], gl.int32, layout=layout), mask=offs < count_blocks)


@gluon.jit
def _gate_up_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, inter_ptr, ids_ptr, counts_ptr, H, I, num_experts, count_blocks,
                        stride_xt, stride_we, stride_wn, stride_se, stride_sg, stride_it, TOP_K: gl.constexpr,
                        GROUP: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZERO: gl.constexpr, TILES: gl.constexpr,
                        STAGES: gl.constexpr, MASK_K: gl.constexpr, PDL: gl.constexpr, TRIGGER_START: gl.constexpr,
                        ZERO_COUNTS: gl.constexpr):
    """inter[p, n] = silu(gate) * up of pair p's token through its expert, for 16 x warps rows n from program_id(1)
    on (x as the MMA's 8-token B operand, the pair's token in its first column). PDL: launched as a programmatic
    dependent of the routing; lets the down GEMV launch once its K loop is done, or with TRIGGER_START right after
    its wait (as `gemv._gate_up_h2_kernel`). ZERO_COUNTS: zeroes the packed down GEMV's arrival counts first
    (`_zero_counts`, for its fold)."""
    WARPS: gl.constexpr = gl.num_warps()
    HALF: gl.constexpr = 16 * WARPS
    if PDL:  # as `tiles._pdl_wait` (Triton's own griddepcontrol builtins run in Gluon too)
        tl.extra.cuda.gdc_wait()
        if TRIGGER_START:
            tl.extra.cuda.gdc_launch_dependents()
    p = gl.program_id(0)
    if ZERO_COUNTS:
        _zero_counts(counts_ptr, p, count_blocks, TOP_K)
    e = gl.load(ids_ptr + p)
    if (e >= 0) & (e < num_experts):  # other ids select nothing; the combine skips their pairs
        e64 = e.to(gl.int64)
        off_n = gl.program_id(1) * HALF
        acc = _mma_acc(x_ptr + (p // TOP_K).to(gl.int64) * stride_xt, w_ptr + e64 * stride_we,
                       s_ptr + e64 * stride_se, z_ptr + e64 * stride_se, 0, 1, H, off_n, I, 0, gl.cdiv(H, 128),
                       stride_xt, stride_wn, stride_sg, None, None, GROUP, PER_CHANNEL, HAS_ZERO, False, None, 0,
                       False, 8, 2, TILES, MASK_K, True, STAGES, True)
        if PDL and not TRIGGER_START:
            tl.extra.cuda.gdc_launch_dependents()
        gate, up = acc.reshape([2, HALF, 8]).permute((1, 2, 0)).split()
        act = gate / (1.0 + gl.exp(-gate)) * up
        _store_token_column(inter_ptr + p.to(gl.int64) * stride_it, act, off_n, I)


@gluon.jit
def _down_mma_kernel(inter_ptr, w_ptr, s_ptr, z_ptr, pair_out_ptr, ids_ptr, topk_w_ptr, H, I, num_experts, per_split,
                     stride_it, stride_we, stride_wn, stride_se, stride_sg, stride_pt, stride_split,
                     GROUP: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZERO: gl.constexpr, REPS: gl.constexpr,
                     TILES: gl.constexpr, STAGES: gl.constexpr, MASK_K: gl.constexpr, PDL: gl.constexpr):
    """pair_out[split, p, n] = topk_weight[p] * (pair p's intermediate row through its expert's down rows n), 16 x
    warps x REPS rows n from program_id(1) on, over split program_id(2)'s K-tiles (`per_split` of them: the combine
    adds the splits' fp32 partial sums; one split stores in pair_out's dtype). PDL: a programmatic dependent of
    the gate/up GEMV, and the combine's."""
    WARPS: gl.constexpr = gl.num_warps()
    BLOCK_N: gl.constexpr = 16 * WARPS * REPS
    if PDL:
        tl.extra.cuda.gdc_wait()
    p = gl.program_id(0)
    split = gl.program_id(2)
    e = gl.load(ids_ptr + p)
    if (e >= 0) & (e < num_experts):
        e64 = e.to(gl.int64)
        off_n = gl.program_id(1) * BLOCK_N
        tile0 = split * per_split
        acc = _mma_acc(inter_ptr + p.to(gl.int64) * stride_it, w_ptr + e64 * stride_we, s_ptr + e64 * stride_se,
                       z_ptr + e64 * stride_se, 0, 1, I, off_n, 0, tile0,
                       gl.minimum(per_split, gl.cdiv(I, 128) - tile0), stride_it, stride_wn, stride_sg, None, None,
                       GROUP, PER_CHANNEL, HAS_ZERO, False, None, 0, False, 8, REPS, TILES, MASK_K, True, STAGES,
                       False)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        _store_token_column(pair_out_ptr + split.to(gl.int64) * stride_split + p.to(gl.int64) * stride_pt,
                            acc * gl.load(topk_w_ptr + p).to(gl.float32), off_n, H)
