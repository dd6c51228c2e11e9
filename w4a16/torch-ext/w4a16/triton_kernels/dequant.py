"""The dequantize kernel: 4-bit weights to fp16 / bf16 / fp32 (dequantize, then cuBLAS, at large M)."""

import triton
import triton.language as tl

from .common import _WORDS, _half_bits, _natural_order, _plane_group, _tile_in_k_order
from .nf4 import _nf4_tables, _nf4_tile_in_k_order


# int4 pairs (planes J, J + 4 of a word: bits 4 J and 16 + 4 J) in 16-bit floats: the nibbles OR-ed under the
# exponent of 1024 (fp16; bf16: 128) read as 1024 + code exactly; minus 1024 + zero that is code - zero, exactly;
# times the scale it is rounded once, as the float32 path rounds (code - zero) * scale. fma with -1 and with -0.0
# rather than sub / mul: the bf16x2 forms of those need sm_90, fma.rn.bf16x2 sm_80. Operands: $1 the biased codes,
# $2 the biased zeros, $3 the scales, each a pair.
_INT4_PAIR_FP16_ASM = tl.constexpr(
    "{\n.reg .b32 t, one, nz;\nmov.b32 one, 0xBC00BC00;\nmov.b32 nz, 0x80008000;\n"
    "fma.rn.f16x2 t, $2, one, $1;\nfma.rn.f16x2 $0, t, $3, nz;\n}")
_INT4_PAIR_BF16_ASM = tl.constexpr(
    "{\n.reg .b32 t, one, nz;\nmov.b32 one, 0xBF80BF80;\nmov.b32 nz, 0x80008000;\n"
    "fma.rn.bf16x2 t, $2, one, $1;\nfma.rn.bf16x2 $0, t, $3, nz;\n}")


@triton.jit
def _int4_pair_planes(w, tile, rows, s_ptr, z_ptr, stride_sg, s_row, z_row, J: tl.constexpr, group_size: tl.constexpr,
                      HAS_ZERO: tl.constexpr, PER_CHANNEL: tl.constexpr, BF16: tl.constexpr):
    """Planes J and J + 4 of a [BLOCK_N, 16] int4 word tile, dequantized in 16-bit floats (see
    `_INT4_PAIR_FP16_ASM`): 2 packed instructions per pair after the shift and mask. Per channel the scale and
    zero pairs are the rows' (`s_row`, `z_row`: int32 bits, [BLOCK_N, 1])."""
    bias = 0x43004300 if BF16 else 0x64006400  # 128.0 / 1024.0 in both halves
    codes = ((w >> (4 * J)) & 0x000F000F) | bias
    if PER_CHANNEL:
        s_pair = s_row
        z_pair = z_row
    else:
        lo_offs = tl.cast(_plane_group(tile, J, group_size), tl.int64) * stride_sg + rows
        hi_offs = tl.cast(_plane_group(tile, J + 4, group_size), tl.int64) * stride_sg + rows
        s_pair = (_half_bits(tl.load(s_ptr + lo_offs)) | (_half_bits(tl.load(s_ptr + hi_offs)) << 16))[:, None]
        if HAS_ZERO:
            z_pair = (tl.load(z_ptr + lo_offs).to(tl.int32) | (tl.load(z_ptr + hi_offs).to(tl.int32) << 16))[:, None]
            z_pair = z_pair + bias
        else:
            z_pair = tl.full([1, 1], 0x00080008 + bias, tl.int32)  # symmetric: zero 8
    args = [codes, tl.broadcast_to(z_pair, codes.shape), tl.broadcast_to(s_pair, codes.shape)]
    if BF16:
        v = tl.inline_asm_elementwise(_INT4_PAIR_BF16_ASM, "=r,r,r,r", args, dtype=tl.int32, is_pure=True, pack=1)
        return v.to(tl.int16).to(tl.bfloat16, bitcast=True), (v >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        v = tl.inline_asm_elementwise(_INT4_PAIR_FP16_ASM, "=r,r,r,r", args, dtype=tl.int32, is_pure=True, pack=1)
        return v.to(tl.int16).to(tl.float16, bitcast=True), (v >> 16).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _word_tile(qw_ptr, rows64, tile, stride_qn, pid_n, BLOCK_N: tl.constexpr, W_DESC: tl.constexpr):
    """K-tile `tile`'s [BLOCK_N, 16] words: by the host descriptor `qw_ptr` (W_DESC) or by pointers."""
    if W_DESC:
        w = qw_ptr.load([pid_n * BLOCK_N, tile * _WORDS])
    else:
        w = tl.load(qw_ptr + rows64[:, None] * stride_qn + tile * _WORDS + tl.arange(0, _WORDS)[None, :],
                    eviction_policy="evict_first")
    return w


@triton.jit
def _store_tile(out_ptr, v, rows64, row_ok, tile, stride_on, K):
    """The [BLOCK_N, 128] values of K-tile `tile` into the output, masked at N and K."""
    k = tile * 128 + tl.arange(0, 128)
    tl.store(out_ptr + rows64[:, None] * stride_on + k[None, :], v, mask=row_ok & (k < K)[None, :])


@triton.jit
def _dequant_tile(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, stride_sg, s_row, z_row, scale, zero, tables,
                  group_size: tl.constexpr, NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
                  PER_CHANNEL: tl.constexpr, NF4_TABLES: tl.constexpr, HALF_SCALE: tl.constexpr,
                  INT4_PAIRS: tl.constexpr, EMULATE: tl.constexpr, DTYPE: tl.constexpr):
    """One [BLOCK_N, 16] word tile as its [BLOCK_N, 128] values in K order, in DTYPE (see `_dequant_kernel`)."""
    if INT4_PAIRS:
        p0, p4 = _int4_pair_planes(w, tile, rows, s_ptr, z_ptr, stride_sg, s_row, z_row, 0, group_size,
                                   HAS_ZERO, PER_CHANNEL, DTYPE == tl.bfloat16)
        p1, p5 = _int4_pair_planes(w, tile, rows, s_ptr, z_ptr, stride_sg, s_row, z_row, 1, group_size,
                                   HAS_ZERO, PER_CHANNEL, DTYPE == tl.bfloat16)
        p2, p6 = _int4_pair_planes(w, tile, rows, s_ptr, z_ptr, stride_sg, s_row, z_row, 2, group_size,
                                   HAS_ZERO, PER_CHANNEL, DTYPE == tl.bfloat16)
        p3, p7 = _int4_pair_planes(w, tile, rows, s_ptr, z_ptr, stride_sg, s_row, z_row, 3, group_size,
                                   HAS_ZERO, PER_CHANNEL, DTYPE == tl.bfloat16)
        v = _natural_order(p0, p1, p2, p3, p4, p5, p6, p7)
    elif NF4_TABLES and PER_CHANNEL:
        v = _nf4_tile_in_k_order(w, tables, cb_ptr, tile, rows, s_ptr, stride_sg, group_size, False, False,
                                 tl.float32, EMULATE) * scale
        v = v.to(DTYPE)
    elif NF4_TABLES:
        v = _nf4_tile_in_k_order(w, tables, cb_ptr, tile, rows, s_ptr, stride_sg, group_size, True, HALF_SCALE,
                                 DTYPE, EMULATE)
    elif PER_CHANNEL:
        v = _tile_in_k_order(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, NF4,
                             HAS_ZERO, False, True, False, tl.float32) * scale
        v = v.to(DTYPE)
    else:
        v = _tile_in_k_order(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, NF4,
                             HAS_ZERO, HAS_MIN, False, False, DTYPE)
    return v


@triton.jit
def _dequant_kernel(
    qw_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, out_ptr,
    N, K, num_tiles, group_size: tl.constexpr, stride_qn, stride_sg, stride_on,
    NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, NF4_TABLES: tl.constexpr, HALF_SCALE: tl.constexpr,
    INT4_PAIRS: tl.constexpr, EMULATE: tl.constexpr, STAGES: tl.constexpr, W_DESC: tl.constexpr,
):
    """Write the dequantized weight ``[N, K]`` (stored K order) in the output's dtype, each 128-column tile
    put back in K order in registers (`_natural_order`) and stored whole: on the H200 1-6 % faster dequantize +
    cuBLAS at M = 1024 than storing the 8 nibble planes as runs of 16 columns (docs/design/w4a16.md, E2b). The
    group size is a compile-time constant, so the 8 planes of a tile share one scale (and zero) load instead of
    one each (E10).

    NF4_TABLES: the codebook is looked up by byte permutes from its values rounded to fp16 (`nf4`, as the
    tensor-core kernel does) instead of gathered per weight as float32, then scaled (HALF_SCALE: by packed fp16
    multiplies, the same single rounding for fp16 values and scales); EMULATE runs the same bits by gathers.
    INT4_PAIRS (int4 without minima into fp16 / bf16, NVIDIA): each pair of weights dequantized by two packed
    instructions (`_int4_pair_planes`), bit-equal to the float32 planes.

    STAGES > 1: the program's TILES K-tiles in a loop whose word loads run STAGES - 1 tiles ahead (a cp.async
    ring, or TMA with W_DESC: the words by a host descriptor, boxes [BLOCK_N, 16]); tiles past the last are
    clamped to it for their loads and not stored. Else the TILES tiles are unrolled. On the H100 the TMA ring of
    16 tiles was 3-8 % faster on the largest Llama-3 shapes and up to 30 % slower on the short ones (E22); no
    table entry takes it yet."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    row_ok = (rows < N)[:, None]
    zero = 0.0
    scale = 1.0
    s_row = 0
    z_row = 0
    dtype = out_ptr.dtype.element_ty
    if PER_CHANNEL and INT4_PAIRS:
        s_row = (_half_bits(tl.load(s_ptr + rows)) * 0x00010001)[:, None]  # the row's scale in both halves
        if HAS_ZERO:
            z_row = (tl.load(z_ptr + rows).to(tl.int32) * 0x00010001)[:, None]
        else:
            z_row = tl.full([BLOCK_N, 1], 0x00080008, tl.int32)
        z_row = z_row + (0x43004300 if dtype == tl.bfloat16 else 0x64006400)
    elif PER_CHANNEL:  # `_plane` leaves per-channel scales to the caller
        scale = tl.load(s_ptr + rows).to(tl.float32)[:, None]
        if HAS_ZERO:
            zero = tl.load(z_ptr + rows).to(tl.float32)[:, None]
    tables = 0
    if NF4_TABLES and not EMULATE:
        tables = _nf4_tables(cb_ptr, False)
    if STAGES > 1:
        for i in tl.range(0, TILES, num_stages=STAGES):
            tile = tl.minimum(pid_t * TILES + i, num_tiles - 1)
            v = _dequant_tile(_word_tile(qw_ptr, rows64, tile, stride_qn, pid_n, BLOCK_N, W_DESC), tile, rows, s_ptr,
                              z_ptr, m_ptr, cb_ptr, stride_sg, s_row, z_row, scale, zero, tables, group_size, NF4,
                              HAS_ZERO, HAS_MIN, PER_CHANNEL, NF4_TABLES, HALF_SCALE, INT4_PAIRS, EMULATE, dtype)
            if pid_t * TILES + i < num_tiles:
                _store_tile(out_ptr, v, rows64, row_ok, tile, stride_on, K)
    else:
        for i in tl.static_range(TILES):
            tile = pid_t * TILES + i
            if tile < num_tiles:
                v = _dequant_tile(_word_tile(qw_ptr, rows64, tile, stride_qn, pid_n, BLOCK_N, W_DESC), tile, rows,
                                  s_ptr, z_ptr, m_ptr, cb_ptr, stride_sg, s_row, z_row, scale, zero, tables, group_size,
                                  NF4, HAS_ZERO, HAS_MIN, PER_CHANNEL, NF4_TABLES, HALF_SCALE, INT4_PAIRS, EMULATE,
                                  dtype)
                _store_tile(out_ptr, v, rows64, row_ok, tile, stride_on, K)
