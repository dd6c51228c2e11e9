"""4-bit decode GEMVs (T <= GEMV_MAX_TOKENS): no tensor cores, the dequantization in the FMA chain."""

import triton
import triton.language as tl

from .tiles import _MAGIC, _MAGIC_BITS, _WORDS, _quant_bases


# 4-bit decode GEMVs (T <= GEMV_MAX_TOKENS): one program per (token, slot) pair and block of output rows, no
# tensor cores. At a few tokens a tl.dot pads them to 16 rows and needs the dequantized tile in the MMA's operand
# layout (a shared-memory round trip per K-tile); here the K loop keeps a [BLOCK_N, TILES, 16] tile of words in
# flight and each int4 weight costs a LOP3, an FADD and an FFMA (`_int4_plane`): 4.7 (down) and 5.3 (gate/up)
# instructions per weight in the K loop's SASS for int4 g128 (sm_90).
# Pairs of one expert each stream its weights (from L2 after the first): worth it only while pairs are few
# (configs.GEMV_MAX_TOKENS).


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
    scaled by 16**-(J % 4) once. Per channel (GROUP -1) the scale is the caller's, after the K loop."""
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
        if NF4 or HAS_MIN:
            zero = 0.0  # NF4 looks codes up; minima add min * sum(x)
        elif HAS_ZERO:  # per group, or per channel (offs: the rows)
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
    if GROUP == -1:  # per channel: one scale per row, applied once
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
