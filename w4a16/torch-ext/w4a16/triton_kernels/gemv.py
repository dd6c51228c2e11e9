"""GEMV kernels for a few tokens on CUDA cores: the portable fp32 `_gemv_kernel` and the packed-fp16
`_gemv_h2_kernel` (NVIDIA, inline PTX; fp16 x, or bf16 x through `_x_to_fp16_kernel`; int4 and NF4)."""

import triton
import triton.language as tl

from .common import _MAGIC, _MAGIC_BITS, _WORDS, _i32, _pdl_launch_dependents, _pdl_wait, _swiglu_rows, _word_tiles
from .nf4 import (_nf4_lane_offsets, _nf4_lane_table, _nf4_pair_table, _nf4_tables, nf4_lookup_asm,
                  nf4_pair_table_asm, nf4_shfl_pair_asm)


@triton.jit
def _store_gemv_rows(result, rows, N, m, pid_n, pid_k, bias_ptr, out_ptr, stride_om, stride_split,
                     HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, SWIGLU: tl.constexpr):
    """A GEMV program's fp32 row results: with the bias into the output, or as this split's partials. SWIGLU (not
    PARTIAL): silu(gate) * up of the program's rows (`_swiglu_rows`) into output columns of half the index."""
    row_ok = rows < N
    if not PARTIAL:
        if HAS_BIAS:
            result += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if SWIGLU:
            act = _swiglu_rows(result[None, :], False)
            cols = pid_n * act.shape[1] + tl.arange(0, act.shape[1])[None, :]
            tl.store(out_ptr + m * stride_om + cols, act.to(out_ptr.dtype.element_ty), mask=cols < N // 2)
        else:
            tl.store(out_ptr + m * stride_om + rows, result.to(out_ptr.dtype.element_ty), mask=row_ok)
    else:
        tl.store(out_ptr + pid_k.to(tl.int64) * stride_split + m * stride_om + rows, result, mask=row_ok)


@triton.jit
def _gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, bias_ptr, out_ptr,
    N, K, num_tiles, tiles_per_split, group_size,
    stride_xm, stride_qn, stride_sg, stride_om, stride_split,
    NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, PER_CHANNEL: tl.constexpr, SUBG: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, MASK_X: tl.constexpr, MASK_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr, SWIGLU: tl.constexpr,
):
    """One token row per program row (grid axis 2), BLOCK_N output rows, TILES K-tiles per iteration.

    The [BLOCK_N, TILES, 16] word tile is loaded with 128-bit loads; each nibble position j is a
    contiguous run of 16 K-columns per word group, multiplied by the matching x run. Partial sums are
    reduced once per scale group and scaled there (one multiply per group, not per weight). With minima
    (HAS_MIN: ``code * scale + min``) the partial sums take the codes as they are and each group adds
    ``min * sum(x)`` over its columns, so the minimum costs one addition of x per weight, not a multiply.

    SWIGLU (a fused gate / up weight in the SwiGLU layout, BLOCK_N >= 16): the output is ``[M, N // 2]``,
    silu(gate) * up of each program's rows (split-K: the reduction kernel applies it to the partials).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tile_ar = tl.arange(0, TILES)
    col = tl.arange(0, _WORDS)
    w_ptrs = qw_ptr + rows.to(tl.int64)[:, None, None] * stride_qn + col[None, None, :]
    x_row = x_ptr + m * stride_xm
    first = pid_k * tiles_per_split
    acc = tl.zeros([BLOCK_N, TILES], dtype=tl.float32)
    if PER_CHANNEL:
        scale = tl.load(s_ptr + rows).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + rows).to(tl.float32)[:, None, None]
    if PREFETCH:
        w_next = _word_tiles(w_ptrs, first + tile_ar, (first + tile_ar < num_tiles) & (tile_ar < tiles_per_split), True)
    for it in tl.range(0, tiles_per_split, TILES, num_stages=STAGES):
        tile = first + it + tile_ar
        live = tile < num_tiles
        if PREFETCH:
            # The next tile's load is issued before this tile's math: two loads in flight per program.
            w = w_next
            ahead = tile + TILES
            w_next = _word_tiles(w_ptrs, ahead, (ahead < num_tiles) & (it + TILES + tile_ar < tiles_per_split), True)
        else:
            w = _word_tiles(w_ptrs, tile, live, MASK_TILES)
        # x is loaded through a pointer tensor of the weight tile's shape (constant along rows), so it gets the
        # weight tile's register layout: a [TILES, 16] x tile needs a shared-memory layout conversion (two
        # barriers and a serialized load) per nibble plane; removing them made the GEMV ~12% faster on the H200.
        k0 = tl.broadcast_to(tile[None, :, None] * 128 + col[None, None, :], (BLOCK_N, TILES, _WORDS))
        part = tl.zeros([BLOCK_N, TILES, _WORDS], dtype=tl.float32)
        if HAS_MIN:
            x_sum = tl.zeros([BLOCK_N, TILES, _WORDS], dtype=tl.float32)
        for j in tl.static_range(8):
            kj = k0 + j * 16
            if MASK_X:
                xj = tl.load(x_row + kj, mask=kj < K, other=0.0).to(tl.float32)
            else:
                xj = tl.load(x_row + kj).to(tl.float32)
            if HAS_ZERO and not PER_CHANNEL and (j * 16) % SUBG == 0:
                group = (tile * 128 + j * 16) // group_size
                zero = tl.load(z_ptr + group[None, :].to(tl.int64) * stride_sg + rows[:, None],
                               mask=live[None, :], other=0).to(tl.float32)[:, :, None]
            if j == 4:
                w_hi = w >> 16
            if NF4:
                if j < 4:
                    code = (w >> (4 * j)) & 0xF
                else:
                    code = (w_hi >> (4 * (j - 4))) & 0xF
                part += tl.load(cb_ptr + code) * xj
            else:
                weight = 1 << (4 * (j % 4))
                if j < 4:
                    bits = w & (0xF << (4 * j))
                else:
                    bits = w_hi & (0xF << (4 * (j - 4)))
                f = (bits | _MAGIC_BITS).to(tl.float32, bitcast=True)
                if HAS_ZERO:
                    f = f - (zero * weight + _MAGIC)
                elif HAS_MIN:
                    f = f - _MAGIC
                    x_sum += xj
                else:
                    f = f - (_MAGIC + 8.0 * weight)
                part += f * (xj * (1.0 / weight))
            if ((j + 1) * 16) % SUBG == 0:  # a scale group ends: scale its partial sums once
                psum = tl.sum(part, axis=2)
                if PER_CHANNEL:
                    acc += psum
                else:
                    group = (tile * 128 + j * 16) // group_size
                    param_offs = group[None, :].to(tl.int64) * stride_sg + rows[:, None]
                    s = tl.load(s_ptr + param_offs, mask=live[None, :], other=0.0)
                    acc += psum * s.to(tl.float32)
                    if HAS_MIN:
                        low = tl.load(m_ptr + param_offs, mask=live[None, :], other=0.0)
                        acc += tl.sum(x_sum, axis=2) * low.to(tl.float32)
                        x_sum = tl.zeros([BLOCK_N, TILES, _WORDS], dtype=tl.float32)
                part = tl.zeros([BLOCK_N, TILES, _WORDS], dtype=tl.float32)
    result = tl.sum(acc, axis=1)
    if PER_CHANNEL:
        result = result * scale
    _store_gemv_rows(result, rows, N, m, pid_n, pid_k, bias_ptr, out_ptr, stride_om, stride_split, HAS_BIAS, PARTIAL,
                     SWIGLU)


# Packed-fp16 GEMV (CUDA only, inline PTX). One 32-bit word holds nibbles j and j + 4 of its K positions in
# its two 16-bit halves (bits 4j.. and 16 + 4j..), so one LOP3 ((w & 0x000F000F) | 0x64006400) makes the
# fp16 pair (1024 + n_j, 1024 + n_{j+4}); planes 1 and 3 are masked without a shift (1024 + 16 n). One HFMA2
# per pair then gives (n - zero) / 16 exactly: (1024 + n) / 16 - (64 + z / 16) and (1024 + 16 n) / 256 -
# (4 + z / 16) are both exact in fp16. The / 16 (undone once on the fp32 result) keeps the fp16 products
# and the 8-term partial sums finite for |x| up to ~16k even when every term has the same sign (8 terms
# of at most 8 |x| / 16 each, symmetric codes) and is harmless for small |x| (subnormals start below
# |x| ~ 2^-10). Per word (8 weights): 4 LOP3 + 1 SHF + 4 HFMA2 (dequant) + 4 HMUL2/HFMA2 (with packed
# x pairs) + 1 HADD2 + 1 convert, then one fp32 FFMA with the group's scale in Triton: 2 instructions per
# weight for the word math (the whole K loop of the H200's winning tiles, index math and x packing included:
# 4.1 SASS instructions per weight, against 6.6 for `_gemv_kernel`). Accuracy: each product and each of
# the 8 partial additions is rounded to fp16 (2^-11 relative), then everything is accumulated in fp32;
# simulated and measured relative errors stay ~2x the fp16 rounding of the output itself
# (docs/design/w4a16/gemv-attempt.md).
# The dequantization both packed-fp16 dots share: W's 8 nibbles as the fp16 pairs t0-t3 of (code - zero) / 16
# (ZLO / ZHI: the zero pairs), t_j holding planes j (low half) and j + 4 (high half).
_H2_DEQUANT_PTX = """.reg .b32 t0, t1, t2, t3, w8, m1, m2, mg, k16, k256;
mov.b32 m1, 0x000F000F;
mov.b32 m2, 0x00F000F0;
mov.b32 mg, 0x64006400;
mov.b32 k16, 0x2C002C00;
mov.b32 k256, 0x1C001C00;
lop3.b32 t0, W, m1, mg, 0xEA;
lop3.b32 t1, W, m2, mg, 0xEA;
shr.u32 w8, W, 8;
lop3.b32 t2, w8, m1, mg, 0xEA;
lop3.b32 t3, w8, m2, mg, 0xEA;
fma.rn.f16x2 t0, t0, k16, ZLO;
fma.rn.f16x2 t1, t1, k256, ZHI;
fma.rn.f16x2 t2, t2, k16, ZLO;
fma.rn.f16x2 t3, t3, k256, ZHI;
"""
_H2_ASM = tl.constexpr(
    "{\n.reg .b32 p;\n.reg .b16 lo, hi;\n"
    + _H2_DEQUANT_PTX.replace("W", "$1").replace("ZLO", "$2").replace("ZHI", "$3")
    + "mul.rn.f16x2 p, t0, $4;\nfma.rn.f16x2 p, t1, $5, p;\nfma.rn.f16x2 p, t2, $6, p;\nfma.rn.f16x2 p, t3, $7, p;\n"
      "mov.b32 {lo, hi}, p;\nadd.rn.f16 lo, lo, hi;\ncvt.f32.f16 $0, lo;\n}")
_ZLO_SYM = tl.constexpr(_i32(0xD408D408))  # fp16 pair -(64 + 8/16): the symmetric zero point 8
_ZHI_SYM = tl.constexpr(_i32(0xC480C480))  # fp16 pair -(4 + 8/16)
_ZLO_BASE = tl.constexpr(_i32(0xD400D400))  # fp16 pair -64: plus z in each half, -(64 + z/16)
# `_H2_ASM` with the dot split by scale groups of 32 columns (planes 0-1, 2-3, 4-5, 6-7 of the tile): the products
# of planes (0 | 4) and (1 | 5) summed in one packed pair give group 0 (low half) and group 2 (high half), those of
# (2 | 6) and (3 | 7) groups 1 and 3; each half converted apart. Per word: 4 LOP3 + 1 SHF + 4 HFMA2 (dequant) +
# 4 HMUL2 / HFMA2 + 2 moves + 4 converts; the caller scales each group (groups of 64: two of these summed).
_H2_GROUPS_ASM = tl.constexpr(
    "{\n.reg .b32 qa, qb;\n.reg .b16 a0, a1, b0, b1;\n"
    + _H2_DEQUANT_PTX.replace("W", "$4").replace("ZLO", "$5").replace("ZHI", "$6")
    + "mul.rn.f16x2 qa, t0, $7;\nfma.rn.f16x2 qa, t1, $8, qa;\nmul.rn.f16x2 qb, t2, $9;\nfma.rn.f16x2 qb, t3, $10, qb;\n"
      "mov.b32 {a0, a1}, qa;\nmov.b32 {b0, b1}, qb;\n"
      "cvt.f32.f16 $0, a0;\ncvt.f32.f16 $1, b0;\ncvt.f32.f16 $2, a1;\ncvt.f32.f16 $3, b1;\n}")


@triton.jit
def _h2_pack(a, b):
    """Two fp16 tensors as one int32 tensor of fp16 pairs (a in the low half)."""
    lo = a.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = b.to(tl.int16, bitcast=True).to(tl.int32) << 16
    return lo | hi


@triton.jit
def _h2_low(v):
    """The fp16 in the low half of each int32, as fp32 (interpreter emulation only)."""
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


# -(4 + z/16) = -(64 + z/16) + 60 as fp16 pairs: one HADD2, exact (z/16 has 4 fractional bits, the sum < 2^6)
_ZHI_FROM_ZLO_ASM = tl.constexpr("{\n.reg .b32 c;\nmov.b32 c, 0x53805380;\nadd.rn.f16x2 $0, $1, c;\n}")


@triton.jit
def _h2_zero_pairs(zero, EMULATE: tl.constexpr):
    """fp16 pairs -(64 + z/16) and -(4 + z/16) for integer zero points z (int32, 0-255), by integer arithmetic:
    0xD400 is -64, whose ulp is 1/16, so adding z to both halves' bits gives the first pair (one IMAD), and one
    HADD2 the second. Cheap because the packed GEMV's layout holds one (row, tile) per word: this runs per word."""
    zlo = zero * 0x00010001 + _ZLO_BASE
    if EMULATE:
        zhi = (-(4.0 + zero.to(tl.float32) * 0.0625)).to(tl.float16)
        return zlo, _h2_pack(zhi, zhi)
    return zlo, tl.inline_asm_elementwise(_ZHI_FROM_ZLO_ASM, "=r,r", [zlo], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _pick4(J: tl.constexpr, a, b, c, d):
    """Operand J of four (a choice made at compile time, for unrolled loops over packed x pairs)."""
    if J == 0:
        picked = a
    elif J == 1:
        picked = b
    elif J == 2:
        picked = c
    else:
        picked = d
    return picked


@triton.jit
def _h2_word_dot(w, zlo, zhi, xp0, xp1, xp2, xp3, EMULATE: tl.constexpr):
    """sum_j (code_j - zero) / 16 * x_j over the 8 nibbles of each word, as fp32 (see _H2_ASM).

    xp_J packs the x of nibbles J (low half) and J + 4 (high half). EMULATE (the interpreter, which cannot
    run inline PTX) computes the same sum in fp32 from the same packed operands."""
    if EMULATE:  # the per-group emulation, summed
        q0, q1, q2, q3 = _h2_word_groups(w, zlo, zhi, xp0, xp1, xp2, xp3, True)
        return q0 + q1 + q2 + q3
    else:
        return tl.inline_asm_elementwise(_H2_ASM, "=f,r,r,r,r,r,r,r", [w, zlo, zhi, xp0, xp1, xp2, xp3],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _h2_word_groups(w, zlo, zhi, xp0, xp1, xp2, xp3, EMULATE: tl.constexpr):
    """`_h2_word_dot` per 32-column scale group: four fp32 tensors, the sums over planes 0-1, 2-3, 4-5 and 6-7
    (see _H2_GROUPS_ASM). EMULATE computes the same in fp32 from the same packed operands."""
    if EMULATE:
        zero16 = -64.0 - _h2_low(zlo)  # z / 16
        lo01 = tl.zeros(w.shape, dtype=tl.float32)
        lo23 = tl.zeros(w.shape, dtype=tl.float32)
        hi01 = tl.zeros(w.shape, dtype=tl.float32)
        hi23 = tl.zeros(w.shape, dtype=tl.float32)
        for j in tl.static_range(4):
            xp = _pick4(j, xp0, xp1, xp2, xp3)
            lo = (((w >> (4 * j)) & 0xF).to(tl.float32) * 0.0625 - zero16) * _h2_low(xp)
            hi = (((w >> (16 + 4 * j)) & 0xF).to(tl.float32) * 0.0625 - zero16) * _h2_low(xp >> 16)
            if j < 2:
                lo01 += lo
                hi01 += hi
            else:
                lo23 += lo
                hi23 += hi
        return lo01, lo23, hi01, hi23
    else:
        return tl.inline_asm_elementwise(_H2_GROUPS_ASM, "=f,=f,=f,=f,r,r,r,r,r,r,r",
                                         [w, zlo, zhi, xp0, xp1, xp2, xp3],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


# x summed over each 32-column group's planes from the packed x pairs (j | j + 4): (0 | 4) + (1 | 5) gives
# groups 0 and 2, (2 | 6) + (3 | 7) groups 1 and 3 (the order of _H2_GROUPS_ASM); fp16 sums of two x.
_X_GROUP_SUMS_ASM = tl.constexpr("""
{
.reg .b32 a, b;
.reg .b16 a0, a1, b0, b1;
add.rn.f16x2 a, $4, $5;
add.rn.f16x2 b, $6, $7;
mov.b32 {a0, a1}, a;
mov.b32 {b0, b1}, b;
cvt.f32.f16 $0, a0;
cvt.f32.f16 $1, b0;
cvt.f32.f16 $2, a1;
cvt.f32.f16 $3, b1;
}
""")


@triton.jit
def _x_group_sums(xp0, xp1, xp2, xp3, EMULATE: tl.constexpr):
    """Four fp32 tensors: each word position's x summed over the planes of 32-column groups 0-3 of its tile (for
    the minima's ``min * sum(x)``), from the packed x pairs; EMULATE the same from the halves in fp32."""
    if EMULATE:
        return (_h2_low(xp0) + _h2_low(xp1), _h2_low(xp2) + _h2_low(xp3), _h2_low(xp0 >> 16) + _h2_low(xp1 >> 16),
                _h2_low(xp2 >> 16) + _h2_low(xp3 >> 16))
    else:
        return tl.inline_asm_elementwise(_X_GROUP_SUMS_ASM, "=f,=f,=f,=f,r,r,r,r", [xp0, xp1, xp2, xp3],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


# NF4 in the packed-fp16 GEMV: a byte-permute (PRMT) looks up 4 bytes at once in an 8-byte table, so the 16
# codebook values / 16, as fp16, live in 8 registers: their low bytes (entries 0-3, 4-7, 8-11, 12-15) and their
# high bytes. Per 4 nibbles: 4 PRMT look up both bytes in both table halves, a shift and a LOP3 turn bit 3 of each
# nibble into a PRMT selector of the half, 2 PRMT pick the half, 2 PRMT interleave
# low and high bytes into the fp16 pairs of nibbles (0, 1) and (2, 3). Nibbles 0-3 and 4-7 of a word are the
# tile's columns 0-63 and 64-127, so each half is summed apart (scale groups of 64 work).
_NF4_PAIRS_DOT_ASM = ("mul.rn.f16x2 t, p, XA;\nfma.rn.f16x2 t, q, XB, t;\nmov.b32 {l16, h16}, t;\n"
                      "add.rn.f16 l16, l16, h16;\ncvt.f32.f16 OUT, l16;\n")  # the pairs p, q times x, summed


def _nf4_word_dot_asm(shuffled: int) -> tuple[str, str]:
    """PTX and constraints of `_nf4_word_dot`: its two sums from the word at $2, nibbles 0-3 then 4-7, the first
    `shuffled` (0, 1 or 2) of those halves looked up by warp shuffles (`nf4.nf4_shfl_pair_asm`, from this lane's
    entry), the others by PRMT in the 8 tables. Operands: $2 the word, the tables (unless both halves shuffle),
    the lane entry (if one does), then the 4 x pairs."""
    n = 3
    if shuffled < 2:
        tables, n = n, n + 8
    if shuffled:
        lane, n = f"${n}", n + 1
    x_pairs = [f"${n + i}" for i in range(4)]
    text = "{\n.reg .b32 s, x, la, lb, ha, hb, lo, hi, va, vb, p, q, t, w2;\n.reg .b16 l16, h16;\nshr.b32 w2, $2, 16;\n"
    for half, word in enumerate(("$2", "w2")):
        if half < shuffled:
            text += nf4_shfl_pair_asm(word, 0, word, 1, "p", lane) + nf4_shfl_pair_asm(word, 2, word, 3, "q", lane)
        else:
            text += nf4_lookup_asm(word, tables) + "prmt.b32 p, lo, hi, 0x5140;\nprmt.b32 q, lo, hi, 0x7362;\n"
        text += (_NF4_PAIRS_DOT_ASM.replace("XA", x_pairs[2 * half]).replace("XB", x_pairs[2 * half + 1])
                 .replace("OUT", f"${half}"))
    return text + "}", ",".join(["=f"] * 2 + ["r"] * (n + 2))


_NF4_ASM, _NF4_CONSTRAINTS = (tl.constexpr(v) for v in _nf4_word_dot_asm(0))
_NF4_HALF_SHFL_ASM, _NF4_HALF_SHFL_CONSTRAINTS = (tl.constexpr(v) for v in _nf4_word_dot_asm(1))
_NF4_SHFL_ASM, _NF4_SHFL_CONSTRAINTS = (tl.constexpr(v) for v in _nf4_word_dot_asm(2))
# `_nf4_word_dot`'s sums with the pairs from the shared-memory table (`nf4.nf4_pair_table_asm`): operands $2 the
# word, $3 4 x the lane, $4 the table's base, $5-$8 the x pairs.
_NF4_SMEM_ASM = tl.constexpr(
    "{\n.reg .b32 a, p, q, t;\n.reg .b16 l16, h16;\n"
    + "".join(nf4_pair_table_asm("$2", 2 * half, "$3", "$4", "p") + nf4_pair_table_asm("$2", 2 * half + 1, "$3", "$4", "q")
              + _NF4_PAIRS_DOT_ASM.replace("XA", f"${5 + 2 * half}").replace("XB", f"${6 + 2 * half}")
              .replace("OUT", f"${half}") for half in range(2))
    + "}")


@triton.jit
def _nf4_word_dot(w, tables, cb_ptr, xp0, xp1, xp2, xp3, lane_table, EMULATE: tl.constexpr, SHFL: tl.constexpr,
                  SMEM: tl.constexpr = False):
    """sum_j codebook[code_j] / 16 * x_j over nibbles 0-3 and over 4-7 of each word, as two fp32 tensors.
    xp_J packs the x of nibbles 2J (low half) and 2J + 1. SHFL (0, 1, 2): that many of the two halves looked up
    by warp shuffles from `lane_table` (`nf4._nf4_lane_table`), the rest by PRMT (`_nf4_word_dot_asm`). SMEM:
    both by the shared-memory pair table, `tables` then (4 x lane, table base). EMULATE computes the same in
    fp32."""
    if EMULATE:
        lo = tl.zeros(w.shape, dtype=tl.float32)
        hi = tl.zeros(w.shape, dtype=tl.float32)
        for j in tl.static_range(4):
            xp = _pick4(j, xp0, xp1, xp2, xp3)
            even = tl.load(cb_ptr + ((w >> (8 * j)) & 0xF)) * 0.0625
            odd = tl.load(cb_ptr + ((w >> (8 * j + 4)) & 0xF)) * 0.0625
            term = even * _h2_low(xp) + odd * _h2_low(xp >> 16)
            if j < 2:
                lo += term
            else:
                hi += term
        return lo, hi
    elif SMEM:
        lane, base = tables
        return tl.inline_asm_elementwise(_NF4_SMEM_ASM, "=f,=f,r,r,r,r,r,r,r",
                                         [w, lane, tl.broadcast_to(base, w.shape), xp0, xp1, xp2, xp3],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    elif SHFL == 2:
        return tl.inline_asm_elementwise(_NF4_SHFL_ASM, _NF4_SHFL_CONSTRAINTS, [w, lane_table, xp0, xp1, xp2, xp3],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        l0, l1, l2, l3, h0, h1, h2, h3 = tables
        operands = [w, tl.broadcast_to(l0, w.shape), tl.broadcast_to(l1, w.shape), tl.broadcast_to(l2, w.shape),
                    tl.broadcast_to(l3, w.shape), tl.broadcast_to(h0, w.shape), tl.broadcast_to(h1, w.shape),
                    tl.broadcast_to(h2, w.shape), tl.broadcast_to(h3, w.shape)]
        if SHFL == 1:
            return tl.inline_asm_elementwise(_NF4_HALF_SHFL_ASM, _NF4_HALF_SHFL_CONSTRAINTS,
                                             operands + [lane_table, xp0, xp1, xp2, xp3],
                                             dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_NF4_ASM, _NF4_CONSTRAINTS, operands + [xp0, xp1, xp2, xp3],
                                             dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _h2_x_pair(x_row, k0, K, JA: tl.constexpr, JB: tl.constexpr, MASK_X: tl.constexpr):
    """x at K-columns k0 + 16 JA (low half) and k0 + 16 JB (high half), packed: the operand of planes JA, JB."""
    ka = k0 + JA * 16
    kb = k0 + JB * 16
    if MASK_X:
        xa = tl.load(x_row + ka, mask=ka < K, other=0.0)
        xb = tl.load(x_row + kb, mask=kb < K, other=0.0)
    else:
        xa = tl.load(x_row + ka)
        xb = tl.load(x_row + kb)
    # Integer packing (AND + shift-add), not an inline `mov.b32 {a, b}`: LLVM shares the integer form between
    # the rows a thread holds, the inline form was repeated per row (PTX / SASS of triton 3.9 for sm_90).
    return _h2_pack(xa, xb)


@triton.jit
def _x_to_fp16_kernel(x_ptr, xh_ptr, xs_ptr, K, num_tiles, stride_xm, stride_hm, TILES: tl.constexpr,
                      PDL: tl.constexpr):
    """bf16 activations as fp16 for `_gemv_h2_kernel`: each 128-column tile times a power of two that puts its
    largest |x| in [2^10, 2^11), so bf16's 8-bit significands convert exactly and the packed-fp16 products
    and partial sums stay finite (see _H2_ASM); ``xs`` gets the inverse scale per (row, tile). PDL: a
    programmatic dependent of the kernel before, letting the GEMV launch at once (a few programs, one short wave)."""
    _pdl_wait(PDL)
    _pdl_launch_dependents(PDL)
    m = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1) * TILES + tl.arange(0, TILES)
    cols = tile[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + m * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
    exponent = (tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased, of max |x|
    # 2^(137 - exponent) as fp32 bits; clamped to a normal float (all-zero or tiny tiles get 2^127)
    scale = (tl.minimum(tl.maximum(264 - exponent, 1), 254) << 23).to(tl.float32, bitcast=True)
    tl.store(xh_ptr + m * stride_hm + cols, (x * scale[:, None]).to(tl.float16), mask=cols < K)
    tl.store(xs_ptr + m * num_tiles + tile, 1.0 / scale, mask=tile < num_tiles)


@triton.jit
def _gemv_h2_item(
    pid_n, pid_k, m, tables, lane_table,
    x_ptr, xs_ptr, qw_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, bias_ptr, out_ptr,
    N, K, num_tiles, tiles_per_split, group_size,
    stride_xm, stride_qn, stride_sg, stride_om, stride_split,
    HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, PER_CHANNEL: tl.constexpr, X_SCALED: tl.constexpr,
    NF4: tl.constexpr, HALF_GROUPS: tl.constexpr, INT4_GROUPS: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, MASK_X: tl.constexpr, MASK_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    X_BCAST: tl.constexpr, W_DESC: tl.constexpr, EMULATE: tl.constexpr, SWIGLU: tl.constexpr,
    PDL: tl.constexpr, NF4_SHFL: tl.constexpr, NF4_SMEM: tl.constexpr, TRIGGER_AFTER_LOOP: tl.constexpr,
):
    """One work item of `_gemv_h2_kernel`: rows pid_n * BLOCK_N.. of token m over split pid_k's K-tiles, with the
    NF4 lookup's `tables` / `lane_table` made once per program; TRIGGER_AFTER_LOOP lets the next kernel launch after
    the K loop."""
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tile_ar = tl.arange(0, TILES)
    col = tl.arange(0, _WORDS)
    if not W_DESC:
        w_ptrs = qw_ptr + rows.to(tl.int64)[:, None, None] * stride_qn + col[None, None, :]
    x_row = x_ptr + m * stride_xm
    first = pid_k * tiles_per_split
    acc = tl.zeros([BLOCK_N, TILES, _WORDS], dtype=tl.float32)
    # with float minima too: code * scale + min = (code - 8) * scale + (min + 8 scale), so the fp16 partial sums
    # stay centred (uncentred codes made them large, and the min term cancelled them: 4x the rounding error)
    zlo = tl.full([BLOCK_N, TILES, _WORDS], _ZLO_SYM, tl.int32)
    zhi = tl.full([BLOCK_N, TILES, _WORDS], _ZHI_SYM, tl.int32)
    if PER_CHANNEL:
        scale = tl.load(s_ptr + rows).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + rows).to(tl.int32)[:, None, None]
            zlo, zhi = _h2_zero_pairs(tl.broadcast_to(zero, (BLOCK_N, TILES, _WORDS)), EMULATE)
    if PREFETCH:
        w_next = _word_tiles(w_ptrs, first + tile_ar, (first + tile_ar < num_tiles) & (tile_ar < tiles_per_split), True)
    for it in tl.range(0, tiles_per_split, TILES, num_stages=STAGES):
        tile = first + it + tile_ar
        live = tile < num_tiles
        if W_DESC:  # a box past the last tile reads as zeros
            w = qw_ptr.load([pid_n * BLOCK_N, first + it, 0])
        elif PREFETCH:
            # The next tile's load is issued before this tile's math: two loads in flight per program.
            w = w_next
            ahead = tile + TILES
            w_next = _word_tiles(w_ptrs, ahead, (ahead < num_tiles) & (it + TILES + tile_ar < tiles_per_split), True)
        else:
            w = _word_tiles(w_ptrs, tile, live, MASK_TILES)
        # x through a pointer tensor of the weight tile's shape (as in _gemv_kernel): the loads and the
        # packing are shared by the rows a thread holds. X_BCAST: x as [1, TILES, 16], broadcast over the rows
        # in the dot; then a thread holds all BLOCK_N rows of its (tile, word) positions, loads each x once,
        # and the 16-bit x loads stay out of a pipelined loop's shared-memory ring (staged in the weight tile's
        # shape, x took 4x the weight tile's shared memory).
        if MASK_TILES and not MASK_X:
            # Tiles past the end read the last tile's x (in bounds, unmasked: the loads stay 128-bit; masked
            # loads came out as 16-bit ones) and their partial sums are dropped below.
            x_tile = tl.minimum(tile, num_tiles - 1)
        else:
            x_tile = tile
        if X_BCAST:
            k0 = x_tile[None, :, None] * 128 + col[None, None, :]
        else:
            k0 = tl.broadcast_to(x_tile[None, :, None] * 128 + col[None, None, :], (BLOCK_N, TILES, _WORDS))
        if NF4:  # plane pairs (0, 1), (2, 3), (4, 5), (6, 7)
            xp0 = _h2_x_pair(x_row, k0, K, 0, 1, MASK_X)
            xp1 = _h2_x_pair(x_row, k0, K, 2, 3, MASK_X)
            xp2 = _h2_x_pair(x_row, k0, K, 4, 5, MASK_X)
            xp3 = _h2_x_pair(x_row, k0, K, 6, 7, MASK_X)
        else:  # plane pairs (j, j + 4)
            xp0 = _h2_x_pair(x_row, k0, K, 0, 4, MASK_X)
            xp1 = _h2_x_pair(x_row, k0, K, 1, 5, MASK_X)
            xp2 = _h2_x_pair(x_row, k0, K, 2, 6, MASK_X)
            xp3 = _h2_x_pair(x_row, k0, K, 3, 7, MASK_X)
        if not PER_CHANNEL:
            param_offs = ((tile * 128) // group_size)[None, :].to(tl.int64) * stride_sg + rows[:, None]
            if HAS_ZERO:
                zero = tl.load(z_ptr + param_offs, mask=live[None, :], other=0).to(tl.int32)[:, :, None]
                zlo, zhi = _h2_zero_pairs(tl.broadcast_to(zero, (BLOCK_N, TILES, _WORDS)), EMULATE)
        if PER_CHANNEL:
            s = tl.full([BLOCK_N, TILES], 1.0, tl.float32)
        else:
            s = tl.load(s_ptr + param_offs, mask=live[None, :], other=0.0).to(tl.float32)
        if X_SCALED:
            x_scale = tl.load(xs_ptr + m * num_tiles + x_tile, mask=x_tile < num_tiles, other=0.0)[None, :]
            s = s * x_scale
        if NF4:
            part, part_hi = _nf4_word_dot(w, tables, cb_ptr, xp0, xp1, xp2, xp3, lane_table, EMULATE, NF4_SHFL,
                                          NF4_SMEM)
            if HALF_GROUPS:  # columns 64-127 of the tile are the next scale group: both halves scaled here
                s_hi = tl.load(s_ptr + param_offs + stride_sg, mask=live[None, :], other=0.0).to(tl.float32)
                if X_SCALED:
                    s_hi = s_hi * x_scale
                part = part * s[:, :, None] + part_hi * s_hi[:, :, None]
                s = tl.full([BLOCK_N, TILES], 1.0, tl.float32)
            else:
                part = part + part_hi
        elif INT4_GROUPS == 1 and not HAS_MIN:
            part = _h2_word_dot(w, zlo, zhi, xp0, xp1, xp2, xp3, EMULATE)
        else:
            q0, q1, q2, q3 = _h2_word_groups(w, zlo, zhi, xp0, xp1, xp2, xp3, EMULATE)
            if HAS_MIN:
                x0, x1, x2, x3 = _x_group_sums(xp0, xp1, xp2, xp3, EMULATE)
            if INT4_GROUPS < 4:  # groups of 64 (planes 0-3, 4-7) or one per tile
                q0, q1 = q0 + q1, q2 + q3
                if HAS_MIN:
                    x0, x1 = x0 + x1, x2 + x3
            if INT4_GROUPS == 1:
                q0 = q0 + q1
                if HAS_MIN:
                    x0 = x0 + x1
            part = tl.zeros([BLOCK_N, TILES, _WORDS], dtype=tl.float32)
            for g in tl.static_range(INT4_GROUPS):
                if g == 0:  # the tile's first group: `s`, loaded (and x-scaled) above
                    s_g = s
                else:
                    s_g = tl.load(s_ptr + param_offs + g * stride_sg, mask=live[None, :], other=0.0).to(tl.float32)
                    if X_SCALED:
                        s_g = s_g * x_scale
                part += _pick4(g, q0, q1, q2, q3) * s_g[:, :, None]
                if HAS_MIN:  # acc is in units of 1/16 (undone after the loop): so is the minimum's term
                    low = tl.load(m_ptr + param_offs + g * stride_sg, mask=live[None, :], other=0.0).to(tl.float32)
                    if X_SCALED:
                        low = low * x_scale
                    part += ((low + 8.0 * s_g) * 0.0625)[:, :, None] * _pick4(g, x0, x1, x2, x3)
            s = tl.full([BLOCK_N, TILES], 1.0, tl.float32)
        if MASK_TILES:
            part = tl.where(live[None, :, None], part, 0.0)
        acc += part * s[:, :, None]  # a multiply by the constant 1.0 (per channel, unscaled x) folds away
    if TRIGGER_AFTER_LOOP:
        _pdl_launch_dependents(PDL)
    result = tl.sum(tl.sum(acc, axis=2), axis=1) * 16.0
    if PER_CHANNEL:
        result = result * scale
    _store_gemv_rows(result, rows, N, m, pid_n, pid_k, bias_ptr, out_ptr, stride_om, stride_split, HAS_BIAS, PARTIAL,
                     SWIGLU)


@triton.jit
def _gemv_h2_kernel(
    x_ptr, xs_ptr, qw_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, bias_ptr, out_ptr,
    N, K, num_tiles, tiles_per_split, group_size,
    stride_xm, stride_qn, stride_sg, stride_om, stride_split,
    HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, PER_CHANNEL: tl.constexpr, X_SCALED: tl.constexpr,
    NF4: tl.constexpr, HALF_GROUPS: tl.constexpr, INT4_GROUPS: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, MASK_X: tl.constexpr, MASK_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    X_BCAST: tl.constexpr, W_DESC: tl.constexpr, EMULATE: tl.constexpr, SWIGLU: tl.constexpr,
    PDL: tl.constexpr, NF4_SHFL: tl.constexpr = 0, TRIGGER_START: tl.constexpr = False, NF4_SMEM: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False, row_blocks=1, splits=1, items=1,
):
    """The GEMV of `_gemv_kernel` (same grid, tiles and split-K) with the packed-fp16 dequant and dot of
    `_H2_ASM`: int4 with one scale group per 128-column tile or per channel, fp16 activations (X_SCALED:
    bf16 activations made fp16 by `_x_to_fp16_kernel`, with each tile's scale undone from ``xs``). NF4
    looks the codebook up in the shared-memory pair table (NF4_SMEM, `_NF4_SMEM_ASM`), by PRMT (`_NF4_ASM`) or
    by shuffles (NF4_SHFL) instead, with groups of 64 too (HALF_GROUPS). INT4_GROUPS (2 or 4):
    int4 scale groups of 64 or 32 columns, symmetric or with float minima (`_H2_GROUPS_ASM`); HAS_MIN (any
    int4 group size) takes the codes centred like symmetric ones and adds ``(min + 8 scale) * sum(x)`` per group,
    from x sums of the packed pairs (`_X_GROUP_SUMS_ASM`).

    Every (row, tile, word) element keeps its own fp32 accumulator (one FFMA with its group's scale per
    word); the reductions over words and tiles happen once, after the K loop.

    STAGES > 1 software-pipelines the weight tiles through a shared-memory ring (cp.async, or with W_DESC a
    TMA descriptor ``qw_ptr`` over ``[rows, num_tiles, 16]`` words, boxes of [BLOCK_N, TILES, 16]).

    SWIGLU as in `_gemv_kernel`. PDL: launched as a programmatic dependent of the kernel before
    (`common._pdl_wait`), the next one let launch after the K loop, or with TRIGGER_START (E66) right after the
    wait.

    PERSISTENT: a 1-D grid whose programs take the ``items`` (row blocks x splits x tokens, row blocks first) in
    turn, so that per-program set-up (the NF4 pair table: 32 KB of shared memory stores) is paid once a program
    rather than once an item; the next kernel then launches after a program's last item.
    """
    tables = 0
    lane_table = 0
    if NF4 and not EMULATE:
        if NF4_SMEM:  # filled before the wait: the codebook is not the previous kernel's output
            base = _nf4_pair_table(cb_ptr, True)
            tables = (_nf4_lane_offsets(base, [BLOCK_N, TILES, _WORDS]), base)
        else:
            tables = _nf4_tables(cb_ptr, True)
            if NF4_SHFL > 0:
                lane_table = _nf4_lane_table(tables, [BLOCK_N, TILES, _WORDS])
    _pdl_wait(PDL)
    if TRIGGER_START:
        _pdl_launch_dependents(PDL)
    # Both branches call `_gemv_h2_item` with the kernel's whole argument list (Triton passes no structs). The
    # one-item programs take their item from the grid position: decoding it from a linear index, as the
    # persistent loop does, added 8-88 SASS instructions to their short programs.
    if PERSISTENT:
        for item in range(tl.program_id(0), items, tl.num_programs(0)):
            _gemv_h2_item(item % row_blocks, (item // row_blocks) % splits,
                          (item // (row_blocks * splits)).to(tl.int64), tables, lane_table,
                          x_ptr, xs_ptr, qw_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, bias_ptr, out_ptr,
                          N, K, num_tiles, tiles_per_split, group_size, stride_xm, stride_qn, stride_sg, stride_om,
                          stride_split, HAS_ZERO, HAS_MIN, PER_CHANNEL, X_SCALED, NF4, HALF_GROUPS, INT4_GROUPS,
                          HAS_BIAS, PARTIAL, MASK_X, MASK_TILES, BLOCK_N, TILES, STAGES, PREFETCH, X_BCAST, W_DESC,
                          EMULATE, SWIGLU, PDL, NF4_SHFL, NF4_SMEM, False)
        _pdl_launch_dependents(PDL and not TRIGGER_START)
    else:
        _gemv_h2_item(tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64), tables, lane_table,
                      x_ptr, xs_ptr, qw_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, bias_ptr, out_ptr,
                      N, K, num_tiles, tiles_per_split, group_size, stride_xm, stride_qn, stride_sg, stride_om,
                      stride_split, HAS_ZERO, HAS_MIN, PER_CHANNEL, X_SCALED, NF4, HALF_GROUPS, INT4_GROUPS,
                      HAS_BIAS, PARTIAL, MASK_X, MASK_TILES, BLOCK_N, TILES, STAGES, PREFETCH, X_BCAST, W_DESC,
                      EMULATE, SWIGLU, PDL, NF4_SHFL, NF4_SMEM, not TRIGGER_START)
