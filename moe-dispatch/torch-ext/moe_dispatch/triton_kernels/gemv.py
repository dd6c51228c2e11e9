"""4-bit decode GEMVs: no tensor cores, the dequantization in the FMA chain (`_gate_up_gemv_kernel`,
`_down_gemv_kernel`: every format, fp32 arithmetic) or in packed fp16 (`_gate_up_h2_kernel`, `_down_h2_kernel`:
int4 in scale groups of >= 128 columns or per channel, 16-bit activations)."""

import triton
import triton.language as tl

from .tiles import _MAGIC, _MAGIC_BITS, _WORDS, _pdl_launch_dependents, _pdl_wait, _quant_bases


# The fp32 GEMVs (T <= GEMV_MAX_TOKENS): one program per (token, slot) pair and block of output rows, no
# tensor cores. At a few tokens a tl.dot pads them to 16 rows and needs the dequantized tile in the MMA's operand
# layout (a shared-memory round trip per K-tile); here the K loop keeps a [BLOCK_N, TILES, 16] tile of words in
# flight and each int4 weight costs a LOP3, an FADD and an FFMA (`_int4_plane`): 4.7 (down) and 5.3 (gate/up)
# instructions per weight in the K loop's SASS for int4 g128 (sm_90).
# Pairs of one expert each stream its weights (from L2 after the first): worth it only while pairs are few
# (configs.GEMV_MAX_TOKENS, PACKED_GEMV_MAX_TOKENS).


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
    return _row_results(acc, acc_b, s_base, rows, rows_b, n_ok, 1.0, GROUP)


@triton.jit
def _row_results(acc, acc_b, s_base, rows, rows_b, n_ok, unit, GROUP: tl.constexpr):
    """The fp32 [BLOCK_N] results of two [BLOCK_N, TILES, 16] accumulators of rows `rows` and `rows_b`, times
    `unit`; per channel (GROUP -1) times each row's scale, applied once."""
    out = tl.sum(tl.sum(acc, axis=2), axis=1) * unit
    out_b = tl.sum(tl.sum(acc_b, axis=2), axis=1) * unit
    if GROUP == -1:
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
# Packed-fp16 GEMVs: int4 (symmetric or with zero points) in scale groups of >= 128 columns or per channel
# ----------------------------------------------------------------------------------------------------
# The word math of w4a16's `_gemv_h2_kernel` (moe-dispatch cannot import w4a16; the format contract is the same).
# A 32-bit word holds nibbles j and j + 4 of its 16-column stride in its two 16-bit halves, so one LOP3
# ((w & 0x000F000F) | 0x64006400) makes the fp16 pair (1024 + n_j, 1024 + n_{j+4}) (planes 1 and 3 masked in place:
# 1024 + 16 n) and one HFMA2 turns it into (n - zero) / 16 exactly; 4 HMUL2 / HFMA2 with packed x pairs and an HADD2
# give the word's 8-term dot in fp16, converted once to fp32 and scaled there: ~2 instructions per weight for the
# word math against ~4.7 for `_gemv_chunk`. Products and the 8 partial sums round to fp16 (2^-11 relative); the
# / 16 keeps them finite for fp16 hidden states up to |x| ~8k (8 terms of at most 15 / 16 |x|, w4a16's bound).
# The other x are made fp16 per 128-column tile inside the kernel (X_SCALED: bf16 hidden states, the fp32
# intermediate), times the power of two that puts the tile's largest |x| in [2^10, 2^11) (bf16 converts exactly,
# fp32 rounds to 11 bits; the sums stay below 2^14), the inverse folded into the tile's scale.
_H2_ASM = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, w8, m1, m2, mg, k16, k256, p;
.reg .b16 lo, hi;
mov.b32 m1, 0x000F000F;
mov.b32 m2, 0x00F000F0;
mov.b32 mg, 0x64006400;
mov.b32 k16, 0x2C002C00;
mov.b32 k256, 0x1C001C00;
lop3.b32 t0, $1, m1, mg, 0xEA;
lop3.b32 t1, $1, m2, mg, 0xEA;
shr.u32 w8, $1, 8;
lop3.b32 t2, w8, m1, mg, 0xEA;
lop3.b32 t3, w8, m2, mg, 0xEA;
fma.rn.f16x2 t0, t0, k16, $2;
fma.rn.f16x2 t1, t1, k256, $3;
fma.rn.f16x2 t2, t2, k16, $2;
fma.rn.f16x2 t3, t3, k256, $3;
mul.rn.f16x2 p, t0, $4;
fma.rn.f16x2 p, t1, $5, p;
fma.rn.f16x2 p, t2, $6, p;
fma.rn.f16x2 p, t3, $7, p;
mov.b32 {lo, hi}, p;
add.rn.f16 lo, lo, hi;
cvt.f32.f16 $0, lo;
}""")
_ZLO_SYM = tl.constexpr(-737618936)  # 0xD408D408: the fp16 pair -(64 + 8/16), the symmetric zero point 8
_ZHI_SYM = tl.constexpr(-998194048)  # 0xC480C480: the fp16 pair -(4 + 8/16)


@triton.jit
def _h2_pack(a, b):
    """Two fp16 tensors as one int32 tensor of fp16 pairs (a in the low half)."""
    lo = a.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = b.to(tl.int16, bitcast=True).to(tl.int32) << 16
    return lo | hi


@triton.jit
def _h2_low(v):
    """The fp16 in the low half of each int32, as fp32 (the interpreter's emulation)."""
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


_ZLO_BASE = tl.constexpr(-738143232)  # 0xD400D400: the fp16 pair -64, plus z in each half -(64 + z/16)
# -(4 + z/16) = -(64 + z/16) + 60 as fp16 pairs: one HADD2, exact (z/16 has 4 fractional bits, the sum < 2^6)
_ZHI_FROM_ZLO_ASM = tl.constexpr("{\n.reg .b32 c;\nmov.b32 c, 0x53805380;\nadd.rn.f16x2 $0, $1, c;\n}")


@triton.jit
def _h2_zero_pairs(zero, EMULATE: tl.constexpr):
    """fp16 pairs -(64 + z/16) and -(4 + z/16) of integer zero points z (int32, 0-255), by integer arithmetic (one
    IMAD: -64's ulp is 1/16) and one HADD2: cheap because the packed GEMV's layout runs this per word."""
    zlo = zero * 0x00010001 + _ZLO_BASE
    if EMULATE:
        zhi = (-(4.0 + zero.to(tl.float32) * 0.0625)).to(tl.float16)
        return zlo, _h2_pack(zhi, zhi)
    return zlo, tl.inline_asm_elementwise(_ZHI_FROM_ZLO_ASM, "=r,r", [zlo], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _h2_word_dot(w, zlo, zhi, xp0, xp1, xp2, xp3, EMULATE: tl.constexpr):
    """sum_j (code_j - zero) / 16 * x_j over the 8 nibbles of each word, as fp32 (`_H2_ASM`); xp_J packs the x of
    nibbles J (low half) and J + 4. EMULATE (the interpreter, which cannot run inline PTX): the same sum in fp32."""
    if EMULATE:
        zero16 = -64.0 - _h2_low(zlo)  # z / 16
        acc = tl.zeros(w.shape, dtype=tl.float32)
        for j in tl.static_range(4):
            if j == 0:
                xp = xp0
            elif j == 1:
                xp = xp1
            elif j == 2:
                xp = xp2
            else:
                xp = xp3
            acc += (((w >> (4 * j)) & 0xF).to(tl.float32) * 0.0625 - zero16) * _h2_low(xp)
            acc += (((w >> (16 + 4 * j)) & 0xF).to(tl.float32) * 0.0625 - zero16) * _h2_low(xp >> 16)
        return acc
    else:
        return tl.inline_asm_elementwise(_H2_ASM, "=f,r,r,r,r,r,r,r", [w, zlo, zhi, xp0, xp1, xp2, xp3],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _x_at(x_row, k, K, MASK: tl.constexpr):
    if MASK:
        return tl.load(x_row + k, mask=k < K, other=0.0)
    return tl.load(x_row + k)


@triton.jit
def _x_tile_scales(x_row, k0, K, MASK: tl.constexpr):
    """Per 128-column tile of x (k0: its first 16 columns), the power of two that puts its largest |x| in
    [2^10, 2^11), clamped to a normal float (an all-zero tile gets 2^127); shape k0's without the last axis."""
    amax = tl.zeros(k0.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        amax = tl.maximum(amax, tl.abs(_x_at(x_row, k0 + 16 * j, K, MASK).to(tl.float32)))
    exponent = (tl.max(amax, axis=2).to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the max
    return (tl.minimum(tl.maximum(264 - exponent, 1), 254) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _x_pair(x_row, k0, K, scale, J: tl.constexpr, X_SCALED: tl.constexpr, MASK: tl.constexpr):
    """The packed fp16 x operand of nibbles J and J + 4 (K-columns k0 + 16 J and k0 + 16 J + 64)."""
    a = _x_at(x_row, k0 + 16 * J, K, MASK)
    b = _x_at(x_row, k0 + 16 * J + 64, K, MASK)
    if X_SCALED:
        a = (a.to(tl.float32) * scale[:, :, None]).to(tl.float16)
        b = (b.to(tl.float32) * scale[:, :, None]).to(tl.float16)
    return _h2_pack(a, b)


@triton.jit
def _h2_tile_params(s_base, z_base, tile, rows, ok, stride_sg, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr,
                    EMULATE: tl.constexpr):
    """[BLOCK_N, TILES] fp32 scales of the word tile and its zero-point pairs (symmetric: the constant pairs);
    per channel (GROUP -1) scale 1 here: the caller scales after the K loop."""
    if GROUP == -1:
        s = tl.full(ok.shape, 1.0, tl.float32)
        zlo, zhi = 0, 0
    else:
        offs = (tile // (GROUP // 128))[None, :].to(tl.int64) * stride_sg + rows[:, None]
        s = tl.load(s_base + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_base + offs, mask=ok, other=0).to(tl.int32)
            zlo, zhi = _h2_zero_pairs(tl.broadcast_to(zero[:, :, None], (ok.shape[0], ok.shape[1], 16)), EMULATE)
        else:
            zlo, zhi = 0, 0
    return s, zlo, zhi


@triton.jit
def _h2_tile(w, s_base, z_base, tile, rows, ok, stride_sg, zlo, zhi, x_unscale, xp0, xp1, xp2, xp3,
             HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, X_SCALED: tl.constexpr, EMULATE: tl.constexpr):
    """A [BLOCK_N, TILES, 16] word tile's fp32 terms: `_h2_word_dot` times the tile's group scales (times the
    inverse of x's tile scale, `x_unscale`, when X_SCALED). zlo / zhi: the symmetric or per-row (per channel) zero pairs; group zero points
    replace them with the tile's own."""
    s, z_lo, z_hi = _h2_tile_params(s_base, z_base, tile, rows, ok, stride_sg, HAS_ZERO, GROUP, EMULATE)
    if GROUP != -1 and HAS_ZERO:
        zlo, zhi = z_lo, z_hi
    if X_SCALED:
        s = s * x_unscale
    return _h2_word_dot(w, zlo, zhi, xp0, xp1, xp2, xp3, EMULATE) * s[:, :, None]


@triton.jit
def _h2_words(w_src, rows, w_row, tile, ok, step_first, stride_qn, W_DESC: tl.constexpr):
    """The [BLOCK_N, TILES, 16] words of rows `rows` at K-tiles `tile` (the first is `step_first`): a TMA box from
    the descriptor `w_src` at descriptor row `w_row` (past the last tile: zeros), or masked pointer loads."""
    if W_DESC:
        w = w_src.load([w_row, step_first, 0])
    else:
        col = tl.arange(0, _WORDS)
        ptrs = w_src + rows[:, None, None] * stride_qn + tile[None, :, None] * _WORDS + col[None, None, :]
        w = tl.load(ptrs, mask=ok[:, :, None], other=0, eviction_policy="evict_first")
    return w


@triton.jit
def _h2_step(x_row, w, w_b, s_base, z_base, tile, rows, rows_b, ok, K, stride_sg, zlo, zhi, zlo_b, zhi_b,
             BLOCK_N: tl.constexpr, TWO: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr,
             X_SCALED: tl.constexpr, X_BCAST: tl.constexpr, MASK: tl.constexpr, EMULATE: tl.constexpr):
    """One step of `_h2_rows`: x at the step's tiles as packed fp16 pairs (made fp16 per tile where X_SCALED), and
    the terms of words `w` (and with TWO `w_b`; else the second result repeats the first)."""
    col = tl.arange(0, _WORDS)
    k0 = tile[None, :, None] * 128 + col[None, None, :]
    if not X_BCAST:
        k0 = tl.broadcast_to(k0, (BLOCK_N, tile.shape[0], _WORDS))
    scale = 1.0
    unscale = 1.0
    if X_SCALED:
        scale = _x_tile_scales(x_row, k0, K, MASK)
        # a power of two: the inverse is exact, and one reciprocal per tile replaces a division per row and tile
        unscale = 1.0 / scale
    xp0 = _x_pair(x_row, k0, K, scale, 0, X_SCALED, MASK)
    xp1 = _x_pair(x_row, k0, K, scale, 1, X_SCALED, MASK)
    xp2 = _x_pair(x_row, k0, K, scale, 2, X_SCALED, MASK)
    xp3 = _x_pair(x_row, k0, K, scale, 3, X_SCALED, MASK)
    part = _h2_tile(w, s_base, z_base, tile, rows, ok, stride_sg, zlo, zhi, unscale, xp0, xp1, xp2, xp3, HAS_ZERO,
                    GROUP, X_SCALED, EMULATE)
    part_b = part
    if TWO:
        part_b = _h2_tile(w_b, s_base, z_base, tile, rows_b, ok, stride_sg, zlo_b, zhi_b, unscale, xp0, xp1, xp2, xp3,
                          HAS_ZERO, GROUP, X_SCALED, EMULATE)
    return part, part_b


@triton.jit
def _h2_rows(x_row, w_src, s_base, z_base, rows, rows_b, w_row, w_row_b, n_ok, K, first, per_split, stride_qn,
             stride_sg, w_pre, BLOCK_N: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr, TWO: tl.constexpr,
             HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, X_SCALED: tl.constexpr, X_BCAST: tl.constexpr,
             W_DESC: tl.constexpr, MASK: tl.constexpr, PRELOADED: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 [BLOCK_N] dot products of x_row with weight rows `rows` over K-tiles [first, first + per_split), by
    `_H2_ASM`; TWO: also rows `rows_b` in the same loop (the up rows of a gate / up pair).

    The words come through a `num_stages` ring (STAGES > 1: cp.async copies of pointer loads, or with W_DESC TMA
    boxes of [BLOCK_N, TILES, 16] from the descriptor `w_src` at descriptor rows `w_row` / `w_row_b`; boxes past
    the last tile read as zeros). X_BCAST: x as [1, TILES, 16], broadcast over the rows in the dot (a thread then
    holds all BLOCK_N rows of its word positions and loads each x once); else x in the weight tile's shape.
    MASK: some loop step reaches past K or past the last tile. PRELOADED (one step, not TWO): the caller loaded
    its words `w_pre` (`_h2_words`), before its PDL wait (E64's PRELOAD_WORDS)."""
    num_tiles = tl.cdiv(K, 128)
    tile_ar = tl.arange(0, TILES)
    acc = tl.zeros([BLOCK_N, TILES, _WORDS], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N, TILES, _WORDS], dtype=tl.float32)
    zlo = tl.full([BLOCK_N, TILES, _WORDS], _ZLO_SYM, tl.int32)
    zhi = tl.full([BLOCK_N, TILES, _WORDS], _ZHI_SYM, tl.int32)
    zlo_b, zhi_b = zlo, zhi
    if GROUP == -1 and HAS_ZERO:  # one zero point per row, for all of K
        zero = tl.load(z_base + rows, mask=n_ok, other=0).to(tl.int32)[:, None, None]
        zlo, zhi = _h2_zero_pairs(tl.broadcast_to(zero, (BLOCK_N, TILES, _WORDS)), EMULATE)
        if TWO:
            zero_b = tl.load(z_base + rows_b, mask=n_ok, other=0).to(tl.int32)[:, None, None]
            zlo_b, zhi_b = _h2_zero_pairs(tl.broadcast_to(zero_b, (BLOCK_N, TILES, _WORDS)), EMULATE)
    if PRELOADED:
        tile = first + tile_ar
        ok = n_ok[:, None] & (tile < num_tiles)[None, :]
        acc, _ = _h2_step(x_row, w_pre, w_pre, s_base, z_base, tile, rows, rows, ok, K, stride_sg, zlo, zhi, zlo, zhi,
                          BLOCK_N, False, HAS_ZERO, GROUP, X_SCALED, X_BCAST, MASK, EMULATE)
    else:
        for it in tl.range(0, per_split, TILES, num_stages=STAGES):
            tile = first + it + tile_ar
            ok = n_ok[:, None] & (tile < num_tiles)[None, :]
            w = _h2_words(w_src, rows, w_row, tile, ok, first + it, stride_qn, W_DESC)
            w_b = w
            if TWO:
                w_b = _h2_words(w_src, rows_b, w_row_b, tile, ok, first + it, stride_qn, W_DESC)
            part, part_b = _h2_step(x_row, w, w_b, s_base, z_base, tile, rows, rows_b, ok, K, stride_sg, zlo, zhi,
                                    zlo_b, zhi_b, BLOCK_N, TWO, HAS_ZERO, GROUP, X_SCALED, X_BCAST, MASK, EMULATE)
            acc += part
            if TWO:
                acc_b += part_b
    return _row_results(acc, acc_b, s_base, rows, rows_b, n_ok, 16.0, GROUP)  # the words' dots were / 16


@triton.jit
def _h2_block(w_ptr, e64, stride_we, BLOCK_N: tl.constexpr, W_DESC: tl.constexpr):
    """A packed GEMV program's first row, its [BLOCK_N] rows (int64) and where expert e64's words are read from:
    its base pointer, or with W_DESC the descriptor over all experts' rows."""
    first_row = tl.program_id(1) * BLOCK_N
    rows = (first_row + tl.arange(0, BLOCK_N)).to(tl.int64)
    w_src = w_ptr
    if not W_DESC:
        w_src = w_ptr + e64 * stride_we
    return first_row, rows, w_src


@triton.jit
def _zero_counts(counts_ptr, p, count_blocks, TOP_K: tl.constexpr):
    """The first program of each token (its first pair, first row block) zeroes the token's `count_blocks` arrival
    counts of `_fold_combine`: the down GEMV touches them only after its wait for this grid."""
    if (p % TOP_K == 0) & (tl.program_id(1) == 0):
        base = counts_ptr + (p // TOP_K).to(tl.int64) * count_blocks
        for i in range(0, count_blocks, 128):
            offs = i + tl.arange(0, 128)
            tl.store(base + offs, tl.zeros([128], dtype=tl.int32), mask=offs < count_blocks)


@triton.jit(do_not_specialize=["T"])
def _gate_up_h2_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, inter_ptr, ids_ptr, counts_ptr,
    T, H, I, num_experts, rows_per_expert, count_blocks, stride_xt, stride_we, stride_wn, stride_se, stride_sg,
    stride_it,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
    HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, X_SCALED: tl.constexpr, X_BCAST: tl.constexpr,
    W_DESC: tl.constexpr, MASK: tl.constexpr, PDL: tl.constexpr, TRIGGER_START: tl.constexpr,
    ZERO_COUNTS: tl.constexpr, EMULATE: tl.constexpr,
):
    """`_gate_up_gemv_kernel` with the packed-fp16 dot (`_h2_rows`); W_DESC: w_ptr is a TMA descriptor over all
    experts' words as [E * Np, tiles, 16] (expert e's rows from e * rows_per_expert). PDL: launched as a
    programmatic dependent of the routing (`_pdl_wait`), and lets the down GEMV launch once its K loop is done, or
    with TRIGGER_START right after its wait (E64). ZERO_COUNTS: zeroes the down GEMV's arrival counts first
    (`_zero_counts`, for its FOLD)."""
    _pdl_wait(PDL)
    if TRIGGER_START:
        _pdl_launch_dependents(PDL)
    p = tl.program_id(0)
    if ZERO_COUNTS:
        _zero_counts(counts_ptr, p, count_blocks, TOP_K)
    e = tl.load(ids_ptr + p)
    if (e >= 0) & (e < num_experts):  # other ids select nothing; the combine skips their pairs
        e64 = e.to(tl.int64)
        first_row, rows, w_src = _h2_block(w_ptr, e64, stride_we, BLOCK_N, W_DESC)
        n_ok = rows < I
        w_row = e * rows_per_expert + first_row
        gate, up = _h2_rows(x_ptr + (p // TOP_K).to(tl.int64) * stride_xt, w_src, s_ptr + e64 * stride_se,
                            z_ptr + e64 * stride_se, rows, rows + I, w_row, w_row + I, n_ok, H, 0, tl.cdiv(H, 128),
                            stride_wn, stride_sg, 0, BLOCK_N, TILES, STAGES, True, HAS_ZERO, GROUP, X_SCALED, X_BCAST,
                            W_DESC, MASK, False, EMULATE)
        if not TRIGGER_START:
            _pdl_launch_dependents(PDL)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(inter_ptr + p.to(tl.int64) * stride_it + rows, act.to(inter_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _fold_combine(pair_out_ptr, ids_ptr, counts_ptr, out_ptr, p, rows, n_ok, num_experts, stride_pt, stride_ot,
                  TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """E65: the combine folded into the down GEMV. Every program of a token's pairs counts itself on the token's
    arrival count of its row block (after a CTA barrier: all its threads' stores first; acq_rel: the others'
    stores seen); the last to arrive adds the pairs' rows in slot order exactly as `_combine_kernel` does (one
    split), through L2 (`.cg`), and writes the token's output rows. A token whose pairs select nothing gets zeros."""
    tl.debug_barrier()
    t = p // TOP_K
    arrived = tl.atomic_add(counts_ptr + t.to(tl.int64) * tl.num_programs(1) + tl.program_id(1), 1, sem="acq_rel")
    if arrived == TOP_K - 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pair = t * TOP_K + j
            e = tl.load(ids_ptr + pair)
            picked = (e >= 0) & (e < num_experts)
            row = tl.load(pair_out_ptr + pair.to(tl.int64) * stride_pt + rows, mask=n_ok, other=0.0,
                          cache_modifier=".cg").to(tl.float32)
            acc += tl.where(picked, row, 0.0)  # rows of unpicked pairs were never written
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + rows, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["T"])
def _down_h2_kernel(
    inter_ptr, w_ptr, s_ptr, z_ptr, pair_out_ptr, ids_ptr, topk_w_ptr, counts_ptr, out_ptr,
    T, H, I, num_experts, rows_per_expert, tiles_per_split, stride_it, stride_we, stride_wn, stride_se, stride_sg,
    stride_pt, stride_split, stride_ot,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
    HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, X_SCALED: tl.constexpr, X_BCAST: tl.constexpr,
    W_DESC: tl.constexpr, MASK: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr, FOLD: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """`_down_gemv_kernel` with the packed-fp16 dot, split over K on grid axis 2: split s writes its fp32 partial
    sums to pair_out[s] (the combine adds the splits). PDL as in `_gate_up_h2_kernel` (the combine after it).
    PRELOAD (E64, a K range of one loop step): the program loads that step's words before its wait, while the
    gate/up grid drains; the weights never depend on it, and the pair's expert id was written before the gate/up
    grid passed its own wait. FOLD (E65, one split): `_fold_combine` writes `out_ptr`, no combine launch follows."""
    p = tl.program_id(0)
    split = tl.program_id(2)
    first = split * tiles_per_split
    w_pre = 0
    if PRELOAD:
        e = tl.load(ids_ptr + p)
        e_in = tl.minimum(tl.maximum(e, 0), num_experts - 1)  # an unpicked pair reads expert 0's words, unused
        first_row, rows, w_src = _h2_block(w_ptr, e_in.to(tl.int64), stride_we, BLOCK_N, W_DESC)
        tile = first + tl.arange(0, TILES)
        ok = (rows < H)[:, None] & (tile < tl.cdiv(I, 128))[None, :]
        w_pre = _h2_words(w_src, rows, e_in * rows_per_expert + first_row, tile, ok, first, stride_wn, W_DESC)
    _pdl_wait(PDL)
    if not PRELOAD:
        e = tl.load(ids_ptr + p)
    first_row, rows, w_src = _h2_block(w_ptr, e.to(tl.int64), stride_we, BLOCK_N, W_DESC)
    n_ok = rows < H
    if (e >= 0) & (e < num_experts):
        e64 = e.to(tl.int64)
        acc, _ = _h2_rows(inter_ptr + p.to(tl.int64) * stride_it, w_src, s_ptr + e64 * stride_se,
                          z_ptr + e64 * stride_se, rows, rows, e * rows_per_expert + first_row, 0, n_ok, I,
                          first, tiles_per_split, stride_wn, stride_sg, w_pre, BLOCK_N, TILES, STAGES, False,
                          HAS_ZERO, GROUP, X_SCALED, X_BCAST, W_DESC, MASK, PRELOAD, EMULATE)
        _pdl_launch_dependents(PDL)
        acc *= tl.load(topk_w_ptr + p).to(tl.float32)
        tl.store(pair_out_ptr + split.to(tl.int64) * stride_split + p.to(tl.int64) * stride_pt + rows,
                 acc.to(pair_out_ptr.dtype.element_ty), mask=n_ok)
    if FOLD:
        _fold_combine(pair_out_ptr, ids_ptr, counts_ptr, out_ptr, p, rows, n_ok, num_experts, stride_pt, stride_ot,
                      TOP_K, BLOCK_N)
