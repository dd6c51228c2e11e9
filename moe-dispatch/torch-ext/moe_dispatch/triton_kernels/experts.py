"""Expert kernels: the grouped GEMMs over pairs sorted by expert (large T), the decode kernels (one program per
selected expert, T <= DECODE_MAX_TOKENS), the stream kernels (one token, a few programs per SM), the combine over
the top-k slots, and the dequantization of 4-bit experts for the grouped GEMMs at many tokens per expert."""

import triton
import triton.language as tl

from .tiles import (_dequant_tile, _expert_weights, _matmul_tile, _matmul_tile_q, _pdl_launch_dependents, _pdl_wait,
                    _quant_bases, _swiglu_tile, _swiglu_tile_q)


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


@triton.jit
def _tile_columns(pid_n, col_lo, cols, BLOCK_N: tl.constexpr):
    """(output columns, which are in [col_lo, col_lo + cols), their weight rows) of column block pid_n of a launch
    over the `cols` columns from col_lo; the weight holds those columns from its row 0."""
    offs_n = col_lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_n, offs_n < col_lo + cols, (offs_n - col_lo).to(tl.int64)


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _gate_up_grouped_kernel(
    x_ptr, w_ptr, shared_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, inter_ptr, sorted_ids_ptr, block_expert_ptr,
    num_pairs, H, I, num_m_blocks, num_routed, col_lo, cols, up_row,
    stride_xt, stride_we, stride_wn, stride_sn, stride_se, stride_sg, stride_it,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, QUANT: tl.constexpr, NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
    GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr, PACKED: tl.constexpr, SWAP_AB: tl.constexpr,
):
    """QUANT: 4-bit experts (BLOCK_K is then the packed tile, 128; w_ptr the packed words, s/z/m/cb_ptr their
    scales, zero points, minima and codebook; no shared expert); PACKED / SWAP_AB: how the dots take the
    dequantized tile (`tiles._accumulate`, `launch._dot_flags`). The launch covers the `cols` intermediate columns
    from col_lo: column n's gate row is w's row n - col_lo, its up row up_row further (the whole weight: 0, I, I; a
    chunk of dequantized columns, `launch._dequantized_columns`: col_lo, its width, its width)."""
    pid_n, expert, rows, pairs = _grouped_tile(tl.program_id(0), num_m_blocks, cols, block_expert_ptr,
                                               sorted_ids_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    if expert < 0:  # an unused block
        return
    row_ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n, n_ok, w_rows = _tile_columns(pid_n, col_lo, cols, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if QUANT:
        q_base, s_base, z_base, m_base = _quant_bases(w_ptr, s_ptr, z_ptr, m_ptr, expert, stride_we, stride_se)
        act = _swiglu_tile_q(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :], row_ok, q_base, s_base, z_base,
                             m_base, cb_ptr, w_rows, w_rows + up_row, n_ok, H, stride_wn, stride_sg, PRECISION, UPCAST,
                             BLOCK_M, BLOCK_N, EVEN_K, NF4, HAS_ZERO, HAS_MIN, GROUP, SCALE_ON_ACC,
                             PACKED, SWAP_AB, x_ptr.dtype.element_ty)
    else:
        w_base, stride_n = _expert_weights(w_ptr, shared_ptr, expert, num_routed, stride_we, stride_wn, stride_sn,
                                           HAS_SHARED)
        g_ptrs = w_base + w_rows[None, :] * stride_n + offs_k[:, None]
        act = _swiglu_tile(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :], row_ok,
                           g_ptrs, g_ptrs + up_row * stride_n, n_ok, H, PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
                           EVEN_K)
    tl.store(inter_ptr + rows.to(tl.int64)[:, None] * stride_it + offs_n[None, :],
             act.to(inter_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _down_grouped_kernel(
    inter_ptr, w_ptr, shared_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
    num_pairs, H, I, num_m_blocks, num_routed, col_lo, cols,
    stride_it, stride_we, stride_wn, stride_sn, stride_se, stride_sg, stride_ot,
    HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, QUANT: tl.constexpr, NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
    GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr, PACKED: tl.constexpr, SWAP_AB: tl.constexpr,
):
    """The down projection of the `cols` output columns from col_lo, column n from w's row n - col_lo (see the
    gate/up kernel)."""
    pid_n, expert, rows, pairs = _grouped_tile(tl.program_id(0), num_m_blocks, cols, block_expert_ptr,
                                               sorted_ids_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    if expert < 0:  # an unused block
        return
    row_ok = pairs < num_pairs
    offs_n, n_ok, w_rows = _tile_columns(pid_n, col_lo, cols, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_it + offs_k[None, :]
    if QUANT:
        q_base, s_base, z_base, m_base = _quant_bases(w_ptr, s_ptr, z_ptr, m_ptr, expert, stride_we, stride_se)
        acc = _matmul_tile_q(a_ptrs, row_ok, q_base, s_base, z_base, m_base, cb_ptr, w_rows, n_ok, I,
                             stride_wn, stride_sg, PRECISION, UPCAST, BLOCK_M, BLOCK_N, EVEN_K, NF4, HAS_ZERO,
                             HAS_MIN, GROUP, SCALE_ON_ACC, PACKED, SWAP_AB, inter_ptr.dtype.element_ty)
    else:
        w_base, stride_n = _expert_weights(w_ptr, shared_ptr, expert, num_routed, stride_we, stride_wn, stride_sn,
                                           HAS_SHARED)
        acc = _matmul_tile(a_ptrs, row_ok, w_base + w_rows[None, :] * stride_n + offs_k[:, None], n_ok, I,
                           PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    weight = tl.load(topk_w_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + offs_n[None, :],
             (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _gather_rows_kernel(x_ptr, out_ptr, pair_rows_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, H, stride_xt,
                        stride_ot, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[r] = x[token of sorted pair r] for the rows of used token blocks, zero at padding: the activations of
    the grouped gate / up GEMM in sorted order, for kernels that read them by TMA (`wgmma`), which cannot gather;
    and pair_rows[p] = the sorted row of pair p (written for pairs that picked an expert), for the combine of
    outputs stored in sorted rows. Grid (token blocks, column blocks)."""
    block = tl.program_id(0)
    if tl.load(block_expert_ptr + block) < 0:  # an unused block: no kernel reads its rows
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    if tl.program_id(1) == 0:
        tl.store(pair_rows_ptr + pairs, rows, mask=pairs < num_pairs)
    tokens = (pairs // TOP_K).to(tl.int64)
    values = tl.load(x_ptr + tokens[:, None] * stride_xt + cols[None, :],
                     mask=(pairs < num_pairs)[:, None] & col_ok[None, :], other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :], values, mask=col_ok[None, :])


@triton.jit
def _picked(e, like, num_experts):
    """Whether expert id e selects an expert, as a block shaped like `like` (the interpreter takes no scalar
    comparison into a mask)."""
    e_block = tl.zeros_like(like) + e
    return (e_block >= 0) & (e_block < num_experts)


@triton.jit
def _stream_range(num_items, K_STEPS: tl.constexpr):
    """(first item, loop steps) of a stream program: the items split evenly over the grid."""
    programs = tl.num_programs(0)
    first = tl.program_id(0) * num_items // programs
    return first, ((tl.program_id(0) + 1) * num_items // programs - first) * K_STEPS


@triton.jit
def _stream_step(step, first, n_blocks, ids_ptr, w_ptr, shared_ptr, N, K, num_routed, num_experts, stride_we,
                 stride_wn, stride_sn, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 K_STEPS: tl.constexpr):
    """Loop step `step` of a stream program: (pair, its expert id, weight rows, K columns, rows < N of a picked
    expert, columns < K, the [BLOCK_N, BLOCK_K] weight tile's pointers and the rows' stride, whether it is the
    item's last K step). The shared expert's weights by a select, not a branch, so that the loads stay in the
    pipelined loop."""
    item = first + step // K_STEPS
    pair = item // n_blocks
    ks = step % K_STEPS
    e = tl.load(ids_ptr + pair)
    base = w_ptr + e.to(tl.int64) * stride_we
    stride_n = stride_wn
    if HAS_SHARED:
        shared = e == num_routed
        base = tl.where(shared, shared_ptr, base)
        stride_n = tl.where(shared, stride_sn, stride_wn)
    rows = (item % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = ks * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = (rows < N) & _picked(e, rows, num_experts)  # other ids select nothing; the combine skips their pairs
    w_ptrs = base + rows.to(tl.int64)[:, None] * stride_n + cols[None, :]
    return pair, e, rows, cols, n_ok, cols < K, w_ptrs, stride_n, ks == K_STEPS - 1


# One token (T = 1): each GEMV's (pair, row block) items split evenly over a grid of a few programs per SM, and
# each program streams its items' weight rows through one pipelined loop over (item, K step), so its loads run on
# across item boundaries. The decode kernels instead run one (pair, block) per program, and at a short K (Qwen3's
# down projection: 3 steps) each program is a single round trip, its waves one latency each.
@triton.jit(do_not_specialize=["num_items"])
def _gate_up_stream_kernel(
    x_ptr, w_ptr, shared_ptr, inter_ptr, ids_ptr, H, I, num_routed, num_experts, num_items, n_blocks,
    stride_we, stride_wn, stride_sn, stride_it,
    HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
    STAGES: tl.constexpr, PDL: tl.constexpr,
):
    """inter[p, n] = SiLU(gate_n . x) * (up_n . x) for every picked pair p of the one token, fp32 sums."""
    _pdl_wait(PDL)
    first, steps = _stream_range(num_items, K_STEPS)
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in tl.range(0, steps, num_stages=STAGES):
        pair, _, rows, cols, n_ok, k_ok, w_ptrs, stride_n, last = _stream_step(
            step, first, n_blocks, ids_ptr, w_ptr, shared_ptr, I, H, num_routed, num_experts, stride_we, stride_wn,
            stride_sn, HAS_SHARED, BLOCK_N, BLOCK_K, K_STEPS)
        x = tl.load(x_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32) * x[None, :]
        acc_u += tl.load(w_ptrs + I * stride_n, mask=mask, other=0.0).to(tl.float32) * x[None, :]
        if last:
            gate = tl.sum(acc_g, axis=1)
            act = gate / (1.0 + tl.exp(-gate)) * tl.sum(acc_u, axis=1)
            tl.store(inter_ptr + pair.to(tl.int64) * stride_it + rows, act.to(inter_ptr.dtype.element_ty),
                     mask=n_ok)
        acc_g = tl.where(last, 0.0, acc_g)
        acc_u = tl.where(last, 0.0, acc_u)


@triton.jit(do_not_specialize=["num_items"])
def _down_stream_kernel(
    inter_ptr, w_ptr, shared_ptr, pair_out_ptr, ids_ptr, topk_w_ptr, H, I, num_routed, num_experts, num_items,
    n_blocks, stride_it, stride_we, stride_wn, stride_sn, stride_pt,
    HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
    STAGES: tl.constexpr, PDL: tl.constexpr,
):
    """pair_out[p, n] = w_p * (down_n . inter[p]) for every picked pair p of the one token (`_gate_up_stream_kernel`'s
    items and loop; the combine after it adds the slots)."""
    _pdl_wait(PDL)
    first, steps = _stream_range(num_items, K_STEPS)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in tl.range(0, steps, num_stages=STAGES):
        pair, e, rows, cols, n_ok, k_ok, w_ptrs, _, last = _stream_step(
            step, first, n_blocks, ids_ptr, w_ptr, shared_ptr, H, I, num_routed, num_experts, stride_we, stride_wn,
            stride_sn, HAS_SHARED, BLOCK_N, BLOCK_K, K_STEPS)
        k_ok = k_ok & _picked(e, cols, num_experts)  # an unpicked pair's intermediate row is never written
        x = tl.load(inter_ptr + pair.to(tl.int64) * stride_it + cols, mask=k_ok, other=0.0).to(tl.float32)
        acc += tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * x[None, :]
        if last:
            out = tl.sum(acc, axis=1) * tl.load(topk_w_ptr + pair).to(tl.float32)
            tl.store(pair_out_ptr + pair.to(tl.int64) * stride_pt + rows, out.to(pair_out_ptr.dtype.element_ty),
                     mask=n_ok)
        acc = tl.where(last, 0.0, acc)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, out_ptr, row_lo, N, K,
                       stride_we, stride_wn, stride_se, stride_sg, stride_oe, stride_on,
                       NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """out[e, n, k] = row row_lo + n of 4-bit expert e (n < N) dequantized in fp32 and rounded once to out's dtype
    (as `quantized.dequantize`), one [BLOCK_N, 128] tile per program: grid (experts, row blocks, K-tiles)."""
    e = tl.program_id(0)
    tile = tl.program_id(2)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rows < N
    q_base, s_base, z_base, m_base = _quant_bases(w_ptr, s_ptr, z_ptr, m_ptr, e, stride_we, stride_se)
    w = _dequant_tile(q_base, s_base, z_base, m_base, cb_ptr, (row_lo + rows).to(tl.int64), n_ok, tile, stride_wn,
                      stride_sg, NF4, HAS_ZERO, HAS_MIN, GROUP, False, False, False, out_ptr.dtype.element_ty)
    cols = tile * 128 + tl.arange(0, 128)
    tl.store(out_ptr + e.to(tl.int64) * stride_oe + rows.to(tl.int64)[:, None] * stride_on + cols[None, :], w,
             mask=n_ok[:, None] & (cols < K)[None, :])


@triton.jit
def _combine_kernel(pairs_ptr, ids_ptr, rows_ptr, out_ptr, H, num_experts, stride_pt, stride_ot, stride_split,
                    TOP_K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                    PDL: tl.constexpr):
    """out[t] = sum over slots j, in slot order, of the weighted expert output of pair (t, j), at row t * TOP_K + j
    of `pairs_ptr`, or with ROWS at row ``rows[t * TOP_K + j]`` (outputs in sorted rows); SPLITS > 1: each pair's
    output is that many partial sums (split-K down GEMV, `stride_split` apart), added in split order. PDL: launched
    as a programmatic dependent of the down kernel (`_pdl_wait`)."""
    _pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j)
        picked = (e >= 0) & (e < num_experts)
        if ROWS:  # an unpicked pair has no sorted row: its index is not read
            r = tl.load(rows_ptr + t * TOP_K + j, mask=picked, other=0).to(tl.int64)
        else:
            r = t * TOP_K + j
        row = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            row += tl.load(pairs_ptr + s * stride_split + r * stride_pt + offs, mask=h_ok, other=0.0).to(tl.float32)
        acc += tl.where(picked, row, 0.0)  # rows of unpicked pairs were never written
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
    PACKED: tl.constexpr, SWAP_AB: tl.constexpr, PDL: tl.constexpr,
):
    """QUANT: 4-bit experts, streamed once per selected expert and dequantized in registers (see the grouped kernel).
    PDL: launched as a programmatic dependent of the routing, and lets the down kernel launch once its K loop is
    done."""
    _pdl_wait(PDL)
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
                                 HAS_MIN, GROUP, SCALE_ON_ACC, PACKED, SWAP_AB, x_ptr.dtype.element_ty)
        else:
            w_base, stride_n = _expert_weights(w_ptr, shared_ptr, e, num_routed, stride_we, stride_wn, stride_sn,
                                               HAS_SHARED)
            g_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_n + offs_k[:, None]
            act = _swiglu_tile(a_ptrs, t < T, g_ptrs, g_ptrs + I * stride_n, n_ok, H, PRECISION, UPCAST, BLOCK_T,
                               BLOCK_N, BLOCK_K, EVEN_K)
        _pdl_launch_dependents(PDL)
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
    PACKED: tl.constexpr, SWAP_AB: tl.constexpr, PDL: tl.constexpr,
):
    """Down projection of one selected expert for one column block, written weighted to each slot that picked it.
    PDL as in `_gate_up_decode_kernel` (the combine after it)."""
    _pdl_wait(PDL)
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
                                 HAS_MIN, GROUP, SCALE_ON_ACC, PACKED, SWAP_AB, inter_ptr.dtype.element_ty)
        else:
            w_base, stride_n = _expert_weights(w_ptr, shared_ptr, e, num_routed, stride_we, stride_wn, stride_sn,
                                               HAS_SHARED)
            acc = _matmul_tile(a_ptrs, hit, w_base + offs_n.to(tl.int64)[None, :] * stride_n + offs_k[:, None], n_ok, I,
                               PRECISION, UPCAST, BLOCK_T, BLOCK_N, BLOCK_K, EVEN_K)
        _pdl_launch_dependents(PDL)
        kcols = tl.arange(0, K_POW2)
        topk_w = tl.load(topk_w_ptr + t[:, None] * TOP_K + kcols[None, :], mask=match, other=0.0).to(tl.float32)
        for j in tl.static_range(TOP_K):  # a token that names e in several slots: each slot its own weight
            w_j = tl.sum(tl.where(kcols[None, :] == j, topk_w, 0.0), axis=1)
            picked_j = tl.sum((match & (kcols[None, :] == j)).to(tl.int32), axis=1) > 0
            tl.store(pair_out_ptr + (t * TOP_K + j).to(tl.int64)[:, None] * stride_pt + offs_n[None, :],
                     (acc * w_j[:, None]).to(pair_out_ptr.dtype.element_ty), mask=picked_j[:, None] & n_ok[None, :])
