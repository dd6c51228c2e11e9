"""NF4 codebook lookups: by byte permutes (PRMT), shared by the packed-fp16 GEMV, the tensor-core kernels and the
dequantize kernel of the dequantize + cuBLAS path; and in a shared-memory table of value pairs (the two GEMVs'
default, `_nf4_pair_table`, at the end of this module).

The 16 codebook values as fp16 (divided by 16 for the GEMV, whose int4 arithmetic carries that factor; as they
are for the tensor-core operands) live in 8 registers: the low bytes of entries 0-3, 4-7, 8-11, 12-15 and
then their high bytes (`_nf4_tables`). One PRMT looks up 4 bytes at once in an 8-byte table by the low 3 bits of
4 nibbles; bit 3 of each nibble, shifted into a PRMT selector (0x3210 plus 4 where it is set), picks the table
half of each byte with one more PRMT (`nf4_select_asm`).
"""

from pathlib import Path

import triton
import triton.language as tl

from .common import _half_bits, _natural_order, _plane_group


@triton.jit
def _nf4_byte(cb_ptr, i: tl.constexpr, HIGH: tl.constexpr, SIXTEENTH: tl.constexpr):
    """Byte HIGH of codebook entry i (/ 16 when SIXTEENTH) as fp16, in bits 8 (i % 4) and up."""
    bits = (tl.load(cb_ptr + i) * (0.0625 if SIXTEENTH else 1.0)).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    if HIGH:
        bits = bits >> 8
    return (bits & 0xFF) << (8 * (i % 4))


@triton.jit
def _nf4_quad(cb_ptr, q: tl.constexpr, HIGH: tl.constexpr, SIXTEENTH: tl.constexpr):
    """One PRMT table register: byte HIGH of entries 4q .. 4q + 3."""
    return (_nf4_byte(cb_ptr, 4 * q, HIGH, SIXTEENTH) | _nf4_byte(cb_ptr, 4 * q + 1, HIGH, SIXTEENTH)
            | _nf4_byte(cb_ptr, 4 * q + 2, HIGH, SIXTEENTH) | _nf4_byte(cb_ptr, 4 * q + 3, HIGH, SIXTEENTH))


@triton.jit
def _nf4_tables(cb_ptr, SIXTEENTH: tl.constexpr):
    """The 8 PRMT table registers of the codebook (/ 16 when SIXTEENTH) as fp16 (see _NF4_ASM): low bytes of entries 0-3,
    4-7, 8-11, 12-15, then high bytes. Built from scalar loads, which ptxas keeps in ordinary registers (built
    with a reduction they sat in uniform registers and every PRMT copied them out first)."""
    return (_nf4_quad(cb_ptr, 0, False, SIXTEENTH), _nf4_quad(cb_ptr, 1, False, SIXTEENTH),
            _nf4_quad(cb_ptr, 2, False, SIXTEENTH), _nf4_quad(cb_ptr, 3, False, SIXTEENTH),
            _nf4_quad(cb_ptr, 0, True, SIXTEENTH), _nf4_quad(cb_ptr, 1, True, SIXTEENTH),
            _nf4_quad(cb_ptr, 2, True, SIXTEENTH), _nf4_quad(cb_ptr, 3, True, SIXTEENTH))


def nf4_lookup_asm(selector: str, table: int, stride: int = 1) -> str:
    """PTX that looks up the 4 nibbles in the low 16 bits of register `selector` in the tables at operands
    $table, $table + stride, ... (`_nf4_tables`' order; stride 2 where each table is an int32 input of a pack-2
    asm, which takes an operand per element): the low bytes of the 4 codebook values in `lo`, their high bytes in
    `hi`. Needs .b32 registers s, x, la, lb, ha, hb, lo, hi."""
    return (f"and.b32 s, {selector}, 0x7777;\nshr.b32 x, {selector}, 1;\nlop3.b32 x, x, 0x4444, 0x3210, 0xea;\n"
            + nf4_select_asm("s", "x", [f"${table + stride * i}" for i in range(8)]))


def nf4_select_asm(selector: str, halves: str, tables: list[str]) -> str:
    """The lookup proper: the low 3 bits of the 4 nibbles in the low 16 bits of `selector` pick bytes from both
    halves of the tables (operand names in `_nf4_tables`' order), and PRMT selector `halves` (0x3210 plus 4 in
    each nibble whose code has bit 3 set: bits 3 of the codes shifted down by one, masked, OR 0x3210) picks each
    byte's half: low bytes of the values into `lo`, high bytes into `hi`. Needs .b32 registers la, lb, ha, hb,
    lo, hi."""
    la, lb, ha, hb = (f"{tables[2 * i]}, {tables[2 * i + 1]}" for i in range(4))
    return (f"prmt.b32 la, {la}, {selector};\nprmt.b32 lb, {lb}, {selector};\n"
            f"prmt.b32 ha, {ha}, {selector};\nprmt.b32 hb, {hb}, {selector};\n"
            f"prmt.b32 lo, la, lb, {halves};\nprmt.b32 hi, ha, hb, {halves};\n")


# The lookup by warp shuffles (`nf4_shfl`): the integer pipe, which the PRMT lookup saturates (E16), is half the
# FP32 rate on sm_90, while `shfl.sync.idx` runs on another unit. Lane l holds codebook[l % 16] (`NF4_LANE_ASM`),
# and a shuffle reads the lane named by the low 5 bits of its index, so a word shifted right by 4 j reads
# codebook[nibble j] with no mask (bit 4, the next nibble's lowest, only picks the other copy of the same entry).
# Per 2 nibbles: 2 shuffles, up to 2 shifts and 1 PRMT pairing the two low halves (the PRMT lookup: 5.5).
def nf4_shfl_pair_asm(word_a: str, j_a: int, word_b: str, j_b: int, out: str, lane_table: str) -> str:
    """PTX: `out` = the pair (codebook[nibble j_a of `word_a`], codebook[nibble j_b of `word_b`]) from the lane table
    register `lane_table` (`NF4_LANE_ASM`); needs .b32 registers s, va, vb."""
    lines = []
    for word, nibble, dest in ((word_a, j_a, "va"), (word_b, j_b, "vb")):
        src = word
        if nibble:
            lines.append(f"shr.b32 s, {word}, {4 * nibble};")
            src = "s"
        lines.append(f"shfl.sync.idx.b32 {dest}, {lane_table}, {src}, 0x1f, 0xffffffff;")
    lines.append(f"prmt.b32 {out}, va, vb, 0x5410;")
    return "\n".join(lines) + "\n"


# This lane's codebook entry, codebook[lane % 16] (low half; the high half is never read), looked up once per
# program in the PRMT tables at $1-$8.
NF4_LANE_ASM = tl.constexpr("{\n.reg .b32 l, s, x, la, lb, ha, hb, lo, hi;\nmov.u32 l, %laneid;\n"
                               + nf4_lookup_asm("l", 1)
                               + "prmt.b32 $0, lo, hi, 0x5140;\n}")


@triton.jit
def _nf4_lane_table(tables, shape):
    """`NF4_LANE_ASM` as a tensor of `shape` (every element of a thread the same value, so one register). Its
    operands are scalars, so Triton computes it once per thread and splats it: a splat never moves a value to
    another thread, as a layout conversion of a lane-dependent tensor would (sm_90 TTGIR: `tt.splat`)."""
    t0, t1, t2, t3, t4, t5, t6, t7 = tables
    return tl.inline_asm_elementwise(
        NF4_LANE_ASM, "=r,r,r,r,r,r,r,r,r",
        [tl.broadcast_to(t0, shape), tl.broadcast_to(t1, shape), tl.broadcast_to(t2, shape),
         tl.broadcast_to(t3, shape), tl.broadcast_to(t4, shape), tl.broadcast_to(t5, shape),
         tl.broadcast_to(t6, shape), tl.broadcast_to(t7, shape)],
        dtype=tl.int32, is_pure=True, pack=1)


# The tensor-core kernel's NF4 operands: for each 32-bit word, 4 fp16 pairs (codebook[nibble J] in the low
# half, codebook[nibble J + 4] in the high half), the layout `dot._unit_pair` gives int4. Bytes 0 and 2 of
# the word (nibbles 0, 1, 4, 5) and then bytes 1 and 3 (nibbles 2, 3, 6, 7) are gathered into one selector
# each, looked up (`nf4_lookup_asm`), and 2 PRMT interleave low and high bytes into the pairs (J, J + 4): 24
# instructions per 8 weights. Operands: $0-$3 the pairs, $4 the word, $5-$12 the tables.
_NF4_PAIRS_ASM = tl.constexpr(
    "{\n.reg .b32 t, s, x, la, lb, ha, hb, lo, hi;\n"
    + "prmt.b32 t, $4, 0, 0x4420;\n" + nf4_lookup_asm("t", 5)
    + "prmt.b32 $0, lo, hi, 0x6240;\nprmt.b32 $1, lo, hi, 0x7351;\n"
    + "prmt.b32 t, $4, 0, 0x4431;\n" + nf4_lookup_asm("t", 5)
    + "prmt.b32 $2, lo, hi, 0x6240;\nprmt.b32 $3, lo, hi, 0x7351;\n"
    + "}")


@triton.jit
def _nf4_cb_bits(cb_ptr, code):
    """codebook[code] as fp16 bits in the low half of an int32 (the emulation of `_NF4_PAIRS_ASM`)."""
    return tl.load(cb_ptr + code).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _nf4_pairs(w, tables, cb_ptr, EMULATE: tl.constexpr, SMEM: tl.constexpr = False):
    """The 4 int32 fp16 pairs (planes J, J + 4) of a word tile (see `_NF4_PAIRS_ASM`), from tables of the
    codebook itself (`_nf4_tables(cb_ptr, False)`), or with SMEM from the filled pair table
    (`_NF4_TABLE_PAIRS_ASM`; SMEM 16: the half table); EMULATE computes the same bits by gathers (the interpreter
    has no PTX)."""
    if EMULATE:
        q0 = _nf4_cb_bits(cb_ptr, w & 0xF) | (_nf4_cb_bits(cb_ptr, (w >> 16) & 0xF) << 16)
        q1 = _nf4_cb_bits(cb_ptr, (w >> 4) & 0xF) | (_nf4_cb_bits(cb_ptr, (w >> 20) & 0xF) << 16)
        q2 = _nf4_cb_bits(cb_ptr, (w >> 8) & 0xF) | (_nf4_cb_bits(cb_ptr, (w >> 24) & 0xF) << 16)
        q3 = _nf4_cb_bits(cb_ptr, (w >> 12) & 0xF) | (_nf4_cb_bits(cb_ptr, (w >> 28) & 0xF) << 16)
        return q0, q1, q2, q3
    elif SMEM:
        text: tl.constexpr = _NF4_HALF_TABLE_PAIRS_ASM if SMEM == 16 else _NF4_TABLE_PAIRS_ASM
        return tl.inline_asm_elementwise(text, "=r,=r,=r,=r,r", [w], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    else:
        l0, l1, l2, l3, h0, h1, h2, h3 = tables
        return tl.inline_asm_elementwise(
            _NF4_PAIRS_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
            [w, tl.broadcast_to(l0, w.shape), tl.broadcast_to(l1, w.shape), tl.broadcast_to(l2, w.shape),
             tl.broadcast_to(l3, w.shape), tl.broadcast_to(h0, w.shape), tl.broadcast_to(h1, w.shape),
             tl.broadcast_to(h2, w.shape), tl.broadcast_to(h3, w.shape)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


# Multiplies two fp16 pairs (the codebook values of planes J, J + 4 by their groups' scales), rounded once per
# value like a dequantized weight; Triton would convert each half apart (two conversions and two fp32 multiplies
# per weight).
_HMUL2_ASM = tl.constexpr("mul.rn.f16x2 $0, $1, $2;")


@triton.jit
def _nf4_pair_planes(q, tile, rows, s_ptr, stride_sg, J: tl.constexpr, group_size: tl.constexpr,
                     SCALED: tl.constexpr, HALF_SCALE: tl.constexpr, DTYPE: tl.constexpr):
    """Planes J and J + 4 as DTYPE from the fp16 codebook values in the halves of `q`, times their groups'
    scales when SCALED: by one packed fp16 multiply per pair where HALF_SCALE (fp16 operands and scales: the
    product is exact before its one rounding), else in fp32."""
    if SCALED:
        lo_offs = tl.cast(_plane_group(tile, J, group_size), tl.int64) * stride_sg + rows
        hi_offs = tl.cast(_plane_group(tile, J + 4, group_size), tl.int64) * stride_sg + rows
        s_lo = tl.load(s_ptr + lo_offs)[:, None]
        s_hi = tl.load(s_ptr + hi_offs)[:, None]
    if HALF_SCALE:
        if SCALED:
            s_pair = _half_bits(s_lo) | (_half_bits(s_hi) << 16)
            q = tl.inline_asm_elementwise(_HMUL2_ASM, "=r,r,r", [q, tl.broadcast_to(s_pair, q.shape)],
                                          dtype=tl.int32, is_pure=True, pack=1)
        return (q.to(tl.int16).to(tl.float16, bitcast=True),
                (q >> 16).to(tl.int16).to(tl.float16, bitcast=True))
    lo = q.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (q >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if SCALED:
        lo = lo * s_lo.to(tl.float32)
        hi = hi * s_hi.to(tl.float32)
    return lo.to(DTYPE), hi.to(DTYPE)


@triton.jit
def _nf4_tile_in_k_order(w, tables, cb_ptr, tile, rows, s_ptr, stride_sg, group_size: tl.constexpr,
                         SCALED: tl.constexpr, HALF_SCALE: tl.constexpr, DTYPE: tl.constexpr, EMULATE: tl.constexpr,
                         SMEM: tl.constexpr = False):
    """A [BLOCK_N, 16] NF4 word tile as one [BLOCK_N, 128] operand in K order, the codebook looked up by byte
    permutes or in the pair table (`nf4._nf4_pairs`) instead of one gather per weight."""
    q0, q1, q2, q3 = _nf4_pairs(w, tables, cb_ptr, EMULATE, SMEM)
    p0, p4 = _nf4_pair_planes(q0, tile, rows, s_ptr, stride_sg, 0, group_size, SCALED, HALF_SCALE, DTYPE)
    p1, p5 = _nf4_pair_planes(q1, tile, rows, s_ptr, stride_sg, 1, group_size, SCALED, HALF_SCALE, DTYPE)
    p2, p6 = _nf4_pair_planes(q2, tile, rows, s_ptr, stride_sg, 2, group_size, SCALED, HALF_SCALE, DTYPE)
    p3, p7 = _nf4_pair_planes(q3, tile, rows, s_ptr, stride_sg, 3, group_size, SCALED, HALF_SCALE, DTYPE)
    return _natural_order(p0, p1, p2, p3, p4, p5, p6, p7)


# The lookup by a shared-memory table of value pairs (`"nf4_smem"`, E73): the PRMT lookup's ~2.75 integer
# instructions per weight saturate sm_90's integer pipe (E16) and shuffles the shuffle unit (E23), while one
# 32-bit LDS returns the fp16 pair of a whole byte (2 nibbles). Entry b (a byte: nibbles 2i, 2i + 1 of a word) is
# (codebook[b & 15], codebook[b >> 4]) / 16 as fp16 (the mma GEMV's: in x's dtype), repeated in 32 consecutive
# words, one per lane: lane l reads word 32 b + l, so a warp's 32 lookups hit 32 banks whatever the bytes (one
# copy would average ~3.5-way conflicts). 32 KB a program; per byte a shift and a LOP3 make the address, the
# table's base folds into the LDS.
NF4_PAIR_TABLE = tl.constexpr(str(Path(__file__).with_name("nf4_table.ll")))
NF4_PAIR_TABLE_BYTES = 256 * 32 * 4  # its static shared memory (a launch that sizes its own buffers subtracts it)
# E75: a half table, 16 copies of each entry (lane l reads copy l & 15), for the dot path, whose third program an
# SM the 32 KB evicted (E73e). Lanes l and l + 16 then share a bank where their bytes differ in entry but not in
# parity: ~1.5 wavefronts a warp's lookup on random bytes, against 1.
NF4_HALF_TABLE_BYTES = 256 * 16 * 4


@tl.core.extern
def _nf4_pair_table_base(unused, _semantic=None):
    """The shared address of the pair table (`nf4_table.ll`, linked through the launch's extern_libs)."""
    return tl.core.extern_elementwise("nf4_table", "", [unused],
                                      {(tl.core.dtype("int32"),): ("nf4_pair_table_base", tl.core.dtype("int32"))},
                                      is_pure=True, _semantic=_semantic)


@tl.core.extern
def _nf4_half_table_base(unused, _semantic=None):
    """The shared address of the half table (16 copies an entry, `nf4_table.ll`'s `nf4_pair_table_16`)."""
    return tl.core.extern_elementwise("nf4_table", "", [unused],
                                      {(tl.core.dtype("int32"),): ("nf4_pair_table_16_base", tl.core.dtype("int32"))},
                                      is_pure=True, _semantic=_semantic)


def _nf4_fill_asm(copies: int) -> str:
    """The fill, one 16-byte quarter-row of the table an element: element i stores entry i // (copies / 4)'s pair
    (looked up in the PRMT tables at $3-$10 by the entry's nibbles) 4 times at $2. Consecutive lanes take
    consecutive elements, so a warp's vector store covers 512 contiguous bytes: 4 wavefronts, no bank conflict (an
    entry a thread, 8 stores of 16 bytes each, put a warp's 32 stores in the same 4 banks: 32-way conflicts, 8x the
    fill's time)."""
    return ("{\n.reg .b32 e, s, x, la, lb, ha, hb, lo, hi, p;\n"
            f"shr.b32 e, $1, {(copies // 4).bit_length() - 1};\n" + nf4_lookup_asm("e", 3)
            + "prmt.b32 p, lo, hi, 0x5140;\nst.shared.v4.b32 [$2], {p, p, p, p};\nmov.b32 $0, 0;\n}")


_NF4_FILL_ASM = tl.constexpr(_nf4_fill_asm(32))
_NF4_HALF_FILL_ASM = tl.constexpr(_nf4_fill_asm(16))


@triton.jit
def _nf4_pair_table(cb_ptr, SIXTEENTH: tl.constexpr, HALF: tl.constexpr = False):
    """Fills the pair table (with HALF the half table) from the codebook (/ 16 when SIXTEENTH, as `_nf4_tables`)
    and returns its base address. Every thread of the program calls it (it ends on a barrier); the codebook is a
    constant, so this may run before a dependent launch's wait."""
    t0, t1, t2, t3, t4, t5, t6, t7 = _nf4_tables(cb_ptr, SIXTEENTH)
    if HALF:
        base = _nf4_half_table_base(0)
        quarter = tl.arange(0, 1024)  # 256 entries x 4 quarter-rows of 16 bytes
        text: tl.constexpr = _NF4_HALF_FILL_ASM
    else:
        base = _nf4_pair_table_base(0)
        quarter = tl.arange(0, 2048)  # 256 entries x 8 quarter-rows of 16 bytes
        text: tl.constexpr = _NF4_FILL_ASM
    tables = [tl.broadcast_to(t, quarter.shape) for t in (t0, t1, t2, t3, t4, t5, t6, t7)]
    tl.inline_asm_elementwise(text, "=r,r,r,r,r,r,r,r,r,r,r", [quarter, base + quarter * 16] + tables,
                              dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()
    return base


_LANE_OFFSET_ASM = tl.constexpr("{\n.reg .b32 l;\nmov.u32 l, %laneid;\nshl.b32 $0, l, 2;\n}")


@triton.jit
def _nf4_lane_offsets(base, shape):
    """4 x this thread's lane (the pair table's column), as a tensor of `shape` computed once per thread (scalar
    operand, splat; see `_nf4_lane_table`)."""
    return tl.inline_asm_elementwise(_LANE_OFFSET_ASM, "=r,r", [tl.broadcast_to(base, shape)], dtype=tl.int32,
                                     is_pure=True, pack=1)


def nf4_pair_table_asm(word: str, byte: int, lane: str, base: str, out: str, copies: int = 32) -> str:
    """PTX: `out` = the pair table's entry for byte `byte` of register `word` (its fp16 pair of nibbles 2 byte,
    2 byte + 1), `lane` holding 4 x the lane's copy (the lane; with 16 copies the lane mod 16) and `base` the
    table's address; needs a .b32 register a."""
    row = (4 * copies).bit_length() - 1  # log2 of an entry's bytes
    shift = f"shl.b32 a, {word}, {row};" if byte == 0 else f"shr.b32 a, {word}, {8 * byte - row};"
    return (f"{shift}\nlop3.b32 a, a, {0xFF << row:#x}, {lane}, 0xEA;\nadd.u32 a, a, {base};\n"
            f"ld.shared.b32 {out}, [a];\n")


# The tensor-core kernels' lookups read 4 x the lane (into l) and the table's address (into t: `nf4_pair_table`,
# the symbol `nf4_table.ll` links in) in the PTX itself: as operands they came from a broadcast that Triton could
# not put in the tensor-core operand's layout (a layout conversion through shared memory, E73e). ptxas makes them
# once a thread. Needs .b32 registers l, t. With 16 copies (the half table) l is 4 x the lane mod 16.
def nf4_table_address_ptx(copies: int = 32) -> str:
    lane = "and.b32 l, l, 15;\n" if copies == 16 else ""
    symbol = "nf4_pair_table_16" if copies == 16 else "nf4_pair_table"
    return f"mov.u32 l, %laneid;\n{lane}shl.b32 l, l, 2;\nmov.u32 t, {symbol};\n"

# `_NF4_PAIRS_ASM`'s pairs (J, J + 4) from the shared-memory pair table: bytes 0-3 give the pairs of nibbles
# (0, 1), (2, 3), (4, 5), (6, 7), and 4 PRMT take their halves: 4 LDS, 8 shift / LOP3 and 4 PRMT per 8 weights
# (the byte permutes: 24). Operands: $0-$3 the pairs, $4 the word (lane and address: `nf4_table_address_ptx`).
def _nf4_table_pairs_asm(copies: int) -> str:
    return ("{\n.reg .b32 a, l, t, b0, b1, b2, b3;\n" + nf4_table_address_ptx(copies)
            + "".join(nf4_pair_table_asm("$4", byte, "l", "t", f"b{byte}", copies) for byte in range(4))
            + "prmt.b32 $0, b0, b2, 0x5410;\nprmt.b32 $1, b0, b2, 0x7632;\n"
            + "prmt.b32 $2, b1, b3, 0x5410;\nprmt.b32 $3, b1, b3, 0x7632;\n}")


_NF4_TABLE_PAIRS_ASM = tl.constexpr(_nf4_table_pairs_asm(32))
_NF4_HALF_TABLE_PAIRS_ASM = tl.constexpr(_nf4_table_pairs_asm(16))
