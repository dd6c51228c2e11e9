"""The tensor-core kernel: tl.dot with the int4 / NF4 dequantization inside the K loop."""

import triton
import triton.language as tl

from .common import (_WORDS, _natural_order, _pdl_launch_dependents, _pdl_wait, _plane, _swiglu_rows,
                     _tile_in_k_order)
from .nf4 import _nf4_pair_table, _nf4_tables, _nf4_tile_in_k_order


# Tensor-core operands from integer ops: a nibble shifted into the top 4 mantissa bits of 1.0 (fp16 0x3C00:
# bits 6-9; bf16 0x3F80: bits 3-6) reads as exactly 1 + code / 16. Nibbles j and j + 4 of a word sit at bits
# 4j and 16 + 4j, the two halves of a 32-bit pair, so one shift and a mask-and-OR ((w >> s) & mask | ones) make
# two operands, with no int -> float conversion; one packed subtraction of 1 + zero / 16 then gives
# (code - zero) / 16 exactly (at most 5 significant bits), and the factor 16 goes on the fp32 accumulator.
@triton.jit
def _unit_pair(w, SHIFT: tl.constexpr, BF16: tl.constexpr):
    """Planes j and j + 4 of each word as 1 + code / 16 (SHIFT = 4 j - the mantissa position of the nibble).
    ptxas spends two LOP3 on mask and OR (two immediates) and the zero's subtraction runs per value, not per
    pair. Fusing either (the bits of 1.0 from a register, E4; the pair built and the zero subtracted in inline
    PTX, E5) made Triton send the operand through shared memory: 1.1-2.7x slower on the H200
    (docs/design/w4a16.md)."""
    if SHIFT >= 0:
        t = w >> SHIFT
    else:
        t = w << -SHIFT
    if BF16:
        t = (t & 0x00780078) | 0x3F803F80
        dtype = tl.bfloat16
    else:
        t = (t & 0x03C003C0) | 0x3C003C00
        dtype = tl.float16
    return t.to(tl.int16).to(dtype, bitcast=True), (t >> 16).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def _unit_planes(w, BF16: tl.constexpr):
    """The 8 nibble planes of a word tile as 1 + code / 16 in fp16 (bf16 when BF16)."""
    if BF16:
        p0, p4 = _unit_pair(w, -3, True)
        p1, p5 = _unit_pair(w, 1, True)
        p2, p6 = _unit_pair(w, 5, True)
        p3, p7 = _unit_pair(w, 9, True)
    else:
        p0, p4 = _unit_pair(w, -6, False)
        p1, p5 = _unit_pair(w, -2, False)
        p2, p6 = _unit_pair(w, 2, False)
        p3, p7 = _unit_pair(w, 6, False)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _dot_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, bias_ptr, out_ptr,
    M, N, K, num_tiles, tiles_per_split, group_size: tl.constexpr,
    stride_xm, stride_qn, stride_sg, stride_om, stride_split,
    NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, PER_CHANNEL: tl.constexpr, SUBG: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, MASK_K: tl.constexpr, SCALE_ON_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr,
    FULL_TILE: tl.constexpr, UPCAST: tl.constexpr, PACKED: tl.constexpr,
    X_DESC: tl.constexpr, W_DESC: tl.constexpr, NF4_TABLES: tl.constexpr, NF4_HALF_SCALE: tl.constexpr,
    EMULATE: tl.constexpr, SWIGLU: tl.constexpr, PDL: tl.constexpr, NF4_SMEM: tl.constexpr = False,
):
    """Tensor-core path. Per K-tile either 8 dots of K=16 (one per nibble plane: a contiguous K run) or,
    with FULL_TILE, the 8 planes interleaved back into natural K order and one dot of K=128.

    With one scale group per tile (SCALE_ON_ACC) the dots take the exact integers ``code - zero`` and the
    tile's partial product is scaled once; smaller groups scale the dequantized values, as do weights with
    minima (HAS_MIN: ``code * scale + min`` on the operand). SWAP_AB computes
    ``W @ x.T`` so the weight rows fill the MMA's M dimension when there are few tokens.

    PACKED (int4 with whole-tile or per-channel groups): the planes are ``(code - zero) / 16`` made by one
    integer instruction per weight and one packed subtraction per pair (`_unit_pair`), the 16 and the group scale
    going on the accumulator. On the H200 this takes ~30 % fewer instructions per
    weight than the fp32 planes and won at every M from 16 to 256 (docs/design/w4a16/dot-attempt.md).

    X_DESC / W_DESC: x (boxes [BLOCK_M, 128]) and the weight words (boxes [BLOCK_N, 16]) come through host
    tensor descriptors (TMA; `STAGES` deep), zero-filled past M and K, instead of pointer loads (full-tile
    paths only).

    NF4_TABLES (NF4 on the full-tile path, NVIDIA): the codebook is looked up by byte permutes
    (`_nf4_tile_in_k_order`) rather than gathered per weight, or with NF4_SMEM (`launch._dot_nf4_table_flags`, linked
    through extern_libs) in the shared-memory pair table (NF4_SMEM 16: the half table), filled before the PDL
    wait; EMULATE runs the same bit
    logic by gathers (the interpreter). NF4_HALF_SCALE (fp16 operands and scales, NVIDIA): groups smaller than a
    tile scale the looked-up pairs by packed fp16 multiplies (`nf4._HMUL2_ASM`) instead of in fp32.

    SWIGLU (a fused gate / up weight in the SwiGLU layout): the output is ``[M, N // 2]``, silu(gate) * up of
    the fp32 accumulator after scales and bias (`_swiglu_rows`); split-K partials stay fused rows, and the
    reduction kernel applies it.

    PDL: launched as a programmatic dependent of the kernel before (`common._pdl_wait`), the next one let launch
    after the K loop, as the decode kernels do.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    col = tl.arange(0, _WORDS)
    if not W_DESC:
        w_ptrs = qw_ptr + rows.to(tl.int64)[:, None] * stride_qn + col[None, :]
    if not X_DESC:
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)
    if NF4_TABLES and NF4_SMEM and not EMULATE:  # before the wait: the codebook is not the previous kernel's output
        _nf4_pair_table(cb_ptr, False, NF4_SMEM == 16)
    _pdl_wait(PDL)
    zero = 0.0
    if PACKED and not HAS_ZERO:
        zero = tl.full([BLOCK_N, 1], 8.0, tl.float32)  # symmetric int4
    if PER_CHANNEL:
        scale = tl.load(s_ptr + rows).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + rows).to(tl.float32)[:, None]
    tables = 0
    if NF4_TABLES and not NF4_SMEM and not EMULATE:
        # Tables loaded as row vectors (every row the same values) rather than as scalars: a scalar broadcast into
        # the lookup stops Triton from building the operand in the MMA's layout, and the 16 KB tile then crosses
        # shared memory (1.1-1.3x slower, docs/design/w4a16.md E9). Not on 256-token tiles, where split-K
        # partials came out wrong with them on the H200 (Triton 3.6).
        if BLOCK_M <= 64:
            tables = _nf4_tables(cb_ptr + rows[:, None] * 0, False)
        else:
            tables = _nf4_tables(cb_ptr, False)
    if UPCAST:
        dot_dtype = tl.float32
    elif X_DESC:
        dot_dtype = x_ptr.dtype
    else:
        dot_dtype = x_ptr.dtype.element_ty
    for tile in tl.range(first, last, num_stages=STAGES):
        if W_DESC:
            w = qw_ptr.load([pid_n * BLOCK_N, tile * _WORDS])
        else:
            w = tl.load(w_ptrs + tile * _WORDS, eviction_policy="evict_first")
        if SCALE_ON_ACC:
            part = tl.zeros_like(acc)
        else:
            part = acc
        group_offs = tl.cast((tile * 128) // group_size, tl.int64) * stride_sg + rows  # the tile's first group
        if PACKED or FULL_TILE:  # one K=128 dot: the x tile in column order
            kk = tile * 128 + tl.arange(0, 128)
            if X_DESC:
                xk = x_ptr.load([pid_m * BLOCK_M, tile * 128])
            elif MASK_K:
                xk = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
            else:
                xk = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        if PACKED:
            tile_zero = zero
            if HAS_ZERO and not PER_CHANNEL:
                tile_zero = tl.load(z_ptr + group_offs)[:, None]
            unit_zero = (1.0 + tile_zero.to(tl.float32) * 0.0625).to(dot_dtype)  # exact: 1 + z / 16
            u0, u1, u2, u3, u4, u5, u6, u7 = _unit_planes(w, dot_dtype == tl.bfloat16)
            wt = _natural_order(u0 - unit_zero, u1 - unit_zero, u2 - unit_zero, u3 - unit_zero,
                                u4 - unit_zero, u5 - unit_zero, u6 - unit_zero, u7 - unit_zero)
            wt = wt.to(dot_dtype)
        elif FULL_TILE and NF4_TABLES:
            wt = _nf4_tile_in_k_order(w, tables, cb_ptr, tile, rows, s_ptr, stride_sg, group_size,
                                      not SCALE_ON_ACC and not PER_CHANNEL, NF4_HALF_SCALE, dot_dtype, EMULATE,
                                      NF4_SMEM)
        elif FULL_TILE:
            wt = _tile_in_k_order(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, NF4,
                                  HAS_ZERO, HAS_MIN, PER_CHANNEL, SCALE_ON_ACC, dot_dtype)
        if PACKED or FULL_TILE:
            if SWAP_AB:
                part = tl.dot(wt, tl.trans(xk.to(dot_dtype)), part)
            else:
                part = tl.dot(xk.to(dot_dtype), tl.trans(wt), part)
        else:
            for j in tl.static_range(8):
                kj = tile * 128 + j * 16 + col
                if MASK_K:
                    xj = tl.load(x_rows + kj[None, :], mask=m_ok[:, None] & (kj < K)[None, :], other=0.0)
                else:
                    xj = tl.load(x_rows + kj[None, :], mask=m_ok[:, None], other=0.0)
                wd = _plane(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, j, NF4, HAS_ZERO,
                            HAS_MIN, PER_CHANNEL, SCALE_ON_ACC).to(dot_dtype)
                if SWAP_AB:
                    part = tl.dot(wd, tl.trans(xj.to(dot_dtype)), part)
                else:
                    part = tl.dot(xj.to(dot_dtype), tl.trans(wd), part)
        if SCALE_ON_ACC:
            s = tl.load(s_ptr + group_offs).to(tl.float32)
            if SWAP_AB:
                acc += part * s[:, None]
            else:
                acc += part * s[None, :]
        else:
            acc = part
    _pdl_launch_dependents(PDL)
    row_ok = rows < N
    if PACKED:  # the operands were (q - z) / 16
        acc = acc * 16.0
    if SWAP_AB:
        if PER_CHANNEL:
            acc = acc * scale[:, None]
        out_offs = offs_m.to(tl.int64)[None, :] * stride_om + rows[:, None]
        out_mask = m_ok[None, :] & row_ok[:, None]
    else:
        if PER_CHANNEL:
            acc = acc * scale[None, :]
        out_offs = offs_m.to(tl.int64)[:, None] * stride_om + rows[None, :]
        out_mask = m_ok[:, None] & row_ok[None, :]
    if not PARTIAL:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            if SWAP_AB:
                acc += bias[:, None]
            else:
                acc += bias[None, :]
        if SWIGLU:
            cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            col_ok = cols < N // 2
            if SWAP_AB:
                act_offs = offs_m.to(tl.int64)[None, :] * stride_om + cols[:, None]
                act_mask = m_ok[None, :] & col_ok[:, None]
            else:
                act_offs = offs_m.to(tl.int64)[:, None] * stride_om + cols[None, :]
                act_mask = m_ok[:, None] & col_ok[None, :]
            tl.store(out_ptr + act_offs, _swiglu_rows(acc, SWAP_AB).to(out_ptr.dtype.element_ty), mask=act_mask)
        else:
            tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + pid_k.to(tl.int64) * stride_split + out_offs, acc, mask=out_mask)
