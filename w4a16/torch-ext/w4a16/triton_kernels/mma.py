"""A tensor-core GEMV for decode (1-32 tokens) in Gluon: `mma.sync` (sm_80+) on operands built in registers
(the 2-32-token path of the H200 table and of `tuning.mma_heuristic`; docs/design/w4a16.md E14-E17).

The packed-fp16 GEMV spends ~4 instructions per weight (dequantization, then one HFMA2 per weight pair and per
token), about the H200's whole issue budget at copy bandwidth; the MMA makes the per-token work free. Each warp
owns 16-row blocks of the weight and loads their packed words straight into the MMA's A-operand layout: a
thread of an m16n8k16 A fragment holds columns (2c, 2c + 1) and (2c + 8, 2c + 9) of rows g and g + 8, and word
c of a row holds column 16 j + c at nibble j (`formats`), so the 8 words a thread loads are every fragment of
the K-tile's 8 chunks. One PTX block per two neighbouring words (`_pair_planes_asm`) makes all 8 fragments'
registers: 2 PRMT + 2 SHF + 8 LOP3 + 8 HFMA2 for 16 weights, (code - zero) / 16 exactly in fp16 or bf16 (the
packed-fp16 GEMV's exponent trick). The MMA sums them in fp32; each scale group's sum is scaled once per row.

Formats: int4 with integer zero points or symmetric, scale groups of 32, 64, multiples of 128 or per channel,
NF4 (codebook looked up in the shared-memory pair table, `_nf4_table_planes_asm`, or by byte permutes,
`_nf4_planes_asm`), fp16 or bf16 activations
(`tuning.mma_supported`). No float minima.

Measured on the H200 (runs 34-42): x's fragments straight from global memory 1.42x cuBLAS fp16 at one token;
through shared memory and `ldmatrix` (`X_SMEM`) 2.04x; with every load in a cp.async ring (`STAGES`) 2.4x at 1-8
tokens (the dot path it replaced at 4 tokens: 1.82x), 2.0x at 16 with two 16-row blocks per warp (`REPS`); 32-token
tiles 1.47x at 32 tokens (the dot path: 1.16x); at 64 tokens mma.sync loses to the dot path's wgmma (runs 44-47).
NF4 by byte permutes is integer-issue bound (44 integer instructions per 16 weights), 0.6x of int4's time; its
default lookup is the shared-memory pair table (`nf4`; E73, run 176 on the H100: 1.09x / 1.07x the byte permutes'
speed in geomean at 4 / 16 tokens)."""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .nf4 import (_LANE_OFFSET_ASM, _NF4_FILL_ASM, NF4_LANE_ASM, _nf4_pair_table_base, nf4_pair_table_asm,
                  nf4_select_asm, nf4_shfl_pair_asm)


@gluon.constexpr_function
def _pair_planes_asm(is_fp16):
    """PTX: two neighbouring words a = $8, b = $9 -> outputs $0-$7, the pairs (nibble j of a, nibble j of b) for
    j = 0-7 as ``(magic + code) * k + c_j`` (inputs $10-$17: c_j, the per-chunk zero constants): bytes 0-1 of
    both words side by side (PRMT 0x5410: nibbles 0-3 of a in the low half, of b in the high half), bytes 2-3
    likewise, each nibble put under the exponent by one LOP3. In fp16 the odd nibbles of a byte pair are taken
    where they lie, times 16 (1024 + 16 code keeps the exponent; hence two multipliers k); bf16's 7-bit
    significand cannot hold 128 + 16 code, so there they are shifted down first."""
    kind = "f16x2" if is_fp16 else "bf16x2"
    magic = 0x64006400 if is_fp16 else 0x43004300  # 1024 / 128: its ulp is 1
    k1 = 0x2C002C00 if is_fp16 else 0x3D803D80  # 1/16
    k16 = 0x1C001C00 if is_fp16 else 0x3D803D80  # 1/256 (fp16, odd nibbles times 16); bf16: 1/16 again
    lines = [".reg .b32 q0, q1, q2, q3, k1, k16, t;", f"mov.b32 k1, {k1:#x};", f"mov.b32 k16, {k16:#x};",
             "prmt.b32 q0, $8, $9, 0x5410;", "prmt.b32 q2, $8, $9, 0x7632;",
             "shr.u32 q1, q0, 8;", "shr.u32 q3, q2, 8;"]
    for j in range(8):
        src = f"q{j // 2}"
        if j % 2 == 0:
            lines.append(f"lop3.b32 ${j}, {src}, 0x000f000f, {magic:#x}, 0xea;")
        elif is_fp16:
            lines.append(f"lop3.b32 ${j}, {src}, 0x00f000f0, {magic:#x}, 0xea;")
        else:
            lines += [f"shr.u32 t, {src}, 4;", f"lop3.b32 ${j}, t, 0x000f000f, {magic:#x}, 0xea;"]
    for j in range(8):
        lines.append(f"fma.rn.{kind} ${j}, ${j}, {'k1' if j % 2 == 0 else 'k16'}, ${10 + j};")
    return "{\n" + "\n".join(lines) + "\n}"


@gluon.constexpr_function
def _pair_planes_constraints():
    return ",".join(["=r"] * 8 + ["r"] * 2 + ["r"] * 8)


def _nf4_planes_asm(shuffled: int = 0) -> tuple[str, str]:
    """PTX and constraints: two neighbouring NF4 words a = $8, b = $9 -> outputs $0-$7, the pairs (codebook[nibble j of a],
    codebook[nibble j of b]) / 16 for j = 0-7; the first `shuffled` (0, 1 or 2) of the halves j = 0-3, 4-7 looked
    up by warp shuffles (`nf4.nf4_shfl_pair_asm`: 16 shuffles, 14 shifts and 8 PRMT per 16 weights for both)
    from this lane's entry, the others by byte permutes in the 8 tables (`nf4`). Operands after the words: the
    tables at $10, $12, ..., $24 unless both halves shuffle, then the lane entry (int32 inputs of a pack-2 asm take
    an operand per element: each comes twice). PRMT: bytes p of a and b side by side (PRMT 0x5140 for bytes 0-1,
    0x7362 for 2-3) make the selectors of pairs 2p and 2p + 1 in one 16-bit half; the 3-bit selectors and the half
    selectors of 8 nibbles come from one AND and a shift and a LOP3: 44 instructions per 16 weights (int4's
    `_pair_planes_asm`: 20)."""
    n = 10
    if shuffled < 2:
        tables, n = [f"${n + 2 * i}" for i in range(8)], n + 16
    lane = f"${n}"
    # the words read before any output is written: an output may share a register with a word that is dead after
    # the block (copied for the shuffles, gathered for the byte permutes)
    lines = [".reg .b32 t0, t1, s, x, la, lb, ha, hb, lo, hi, va, vb, wa, wb;", "mov.b32 wa, $8;", "mov.b32 wb, $9;"]
    lines += [f"prmt.b32 t{half}, wa, wb, {selector};" for half, selector in enumerate(("0x5140", "0x7362"))
              if half >= shuffled]
    for half in range(2):
        if half < shuffled:
            lines += [nf4_shfl_pair_asm("wa", j, "wb", j, f"${j}", lane).rstrip("\n")
                      for j in range(4 * half, 4 * half + 4)]
            continue
        # t_h: nibbles a_4h, a_4h+1, b_4h, b_4h+1 (low half), a_4h+2, a_4h+3, b_4h+2, b_4h+3 (high half)
        lines += [f"and.b32 s, t{half}, 0x77777777;", f"shr.u32 x, t{half}, 1;",
                  "lop3.b32 x, x, 0x44444444, 0x32103210, 0xea;"]
        for quarter in range(2):
            j = 4 * half + 2 * quarter
            if quarter:
                lines += ["shr.u32 s, s, 16;", "shr.u32 x, x, 16;"]
            lines.append(nf4_select_asm("s", "x", tables).rstrip("\n"))
            lines += [f"prmt.b32 ${j}, lo, hi, 0x6240;", f"prmt.b32 ${j + 1}, lo, hi, 0x7351;"]
    # inputs: the words, then the tables and / or the lane entry, each twice (n + 2 operands after the outputs)
    return "{\n" + "\n".join(lines) + "\n}", ",".join(["=r"] * 8 + ["r"] * (n + 2 * bool(shuffled) - 8))


def _nf4_table_planes_asm() -> str:
    """PTX: `_nf4_planes_asm`'s outputs from the shared-memory pair table (`nf4.nf4_pair_table_asm`): byte p of each
    word gives the pair of its nibbles 2p, 2p + 1, and 2 PRMT regroup the two words' pairs into (a_j, b_j) for
    j = 2p, 2p + 1: 8 LDS, 16 shift / LOP3 and 8 PRMT per 16 weights. Operands after the words: 4 x the lane,
    then the table's base (each twice: pack 2)."""
    lines = [".reg .b32 a, pa, pb, wa, wb;", "mov.b32 wa, $8;", "mov.b32 wb, $9;"]
    for p in range(4):
        lines += [nf4_pair_table_asm("wa", p, "$10", "$12", "pa").rstrip("\n"),
                  nf4_pair_table_asm("wb", p, "$10", "$12", "pb").rstrip("\n"),
                  f"prmt.b32 ${2 * p}, pa, pb, 0x5410;", f"prmt.b32 ${2 * p + 1}, pa, pb, 0x7632;"]
    return "{\n" + "\n".join(lines) + "\n}"


_NF4_TABLE_PLANES_ASM = gl.constexpr(_nf4_table_planes_asm())
_NF4_PLANES_ASM, _NF4_PLANES_CONSTRAINTS = (gl.constexpr(v) for v in _nf4_planes_asm(0))
_NF4_HALF_SHFL_PLANES_ASM, _NF4_HALF_SHFL_PLANES_CONSTRAINTS = (gl.constexpr(v) for v in _nf4_planes_asm(1))
_NF4_SHFL_PLANES_ASM, _NF4_SHFL_PLANES_CONSTRAINTS = (gl.constexpr(v) for v in _nf4_planes_asm(2))


@gluon.jit
def _nf4_table(cb_ptr, q: gl.constexpr, HIGH: gl.constexpr, dtype: gl.constexpr, FACTOR: gl.constexpr):
    """One lookup table register (`nf4`): byte HIGH of codebook entries 4q .. 4q + 3, each times FACTOR (a power
    of two, so exact) in `dtype`."""
    t = 0
    for e in gl.static_range(4):
        bits = (gl.load(cb_ptr + 4 * q + e).to(gl.float32) * FACTOR).to(dtype).to(gl.int16, bitcast=True)
        bits = bits.to(gl.int32) & 0xFFFF
        if HIGH:
            bits = bits >> 8
        t = t | ((bits & 0xFF) << (8 * e))
    return t


@gluon.jit
def _nf4_tables(cb_ptr, z, dtype: gl.constexpr, FACTOR: gl.constexpr):
    """The 8 lookup tables of the codebook times FACTOR in `dtype` (this GEMV's: / 16; the wgmma kernel's: as it
    is), as tensors shaped like the zero word tile `z`: low bytes of entries 0-3, 4-7, 8-11, 12-15, then high
    bytes. Shared with `wgmma`."""
    return (z + _nf4_table(cb_ptr, 0, False, dtype, FACTOR), z + _nf4_table(cb_ptr, 1, False, dtype, FACTOR),
            z + _nf4_table(cb_ptr, 2, False, dtype, FACTOR), z + _nf4_table(cb_ptr, 3, False, dtype, FACTOR),
            z + _nf4_table(cb_ptr, 0, True, dtype, FACTOR), z + _nf4_table(cb_ptr, 1, True, dtype, FACTOR),
            z + _nf4_table(cb_ptr, 2, True, dtype, FACTOR), z + _nf4_table(cb_ptr, 3, True, dtype, FACTOR))


@gluon.jit
def _nf4_tile(words, tables, lane_entry, x_like, SHFL: gl.constexpr, SMEM: gl.constexpr = False):
    """The K-tile's 8 A operands from NF4 words, in x's dtype (`x_like`): codebook values / 16
    (`_nf4_planes_asm`, SHFL of its halves by warp shuffles from `lane_entry`; SMEM: from the shared-memory pair
    table, `tables` then (4 x lane, base) shaped like the words, `_nf4_table_planes_asm`)."""
    dtype = x_like.dtype
    if SMEM:
        lane, base = tables
        text: gl.constexpr = _NF4_TABLE_PLANES_ASM
        constraints: gl.constexpr = "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r"
        operands = [words, lane, base]
    elif SHFL == 2:
        text: gl.constexpr = _NF4_SHFL_PLANES_ASM
        constraints: gl.constexpr = _NF4_SHFL_PLANES_CONSTRAINTS
        operands = [words, lane_entry]
    else:
        t0, t1, t2, t3, t4, t5, t6, t7 = tables
        if SHFL == 1:
            text: gl.constexpr = _NF4_HALF_SHFL_PLANES_ASM
            constraints: gl.constexpr = _NF4_HALF_SHFL_PLANES_CONSTRAINTS
            operands = [words, t0, t1, t2, t3, t4, t5, t6, t7, lane_entry]
        else:
            text: gl.constexpr = _NF4_PLANES_ASM
            constraints: gl.constexpr = _NF4_PLANES_CONSTRAINTS
            operands = [words, t0, t1, t2, t3, t4, t5, t6, t7]
    return gl.inline_asm_elementwise(text, constraints, operands,
                                     (dtype, dtype, dtype, dtype, dtype, dtype, dtype, dtype), is_pure=True, pack=2)


@gluon.jit
def _nf4_pair_table_fill(cb_ptr, dtype: gl.constexpr, FACTOR: gl.constexpr):
    """`nf4._nf4_pair_table`'s fill in Gluon, the pairs in `dtype` times FACTOR (the mma GEMV's: x's dtype / 16; the
    wgmma kernel's: fp16 as it is); ends on a barrier, and every thread of the (default) partition calls it."""
    WARPS: gl.constexpr = gl.num_warps()
    fill_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    quarter = gl.arange(0, 2048, layout=fill_layout)  # consecutive lanes, consecutive 16-byte stores
    base = _nf4_pair_table_base(gl.zeros_like(quarter))
    t0, t1, t2, t3, t4, t5, t6, t7 = _nf4_tables(cb_ptr, gl.zeros_like(quarter), dtype, FACTOR)
    gl.inline_asm_elementwise(_NF4_FILL_ASM, "=r,r,r,r,r,r,r,r,r,r,r", [quarter, base + quarter * 16, t0, t1, t2, t3,
                                                                         t4, t5, t6, t7],
                              gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()


@gluon.jit
def _nf4_pair_table(cb_ptr, words_like, dtype: gl.constexpr):
    """Fills the pair table in `dtype` (x's) / 16 (`_nf4_pair_table_fill`) and returns (4 x lane, base) shaped like
    `words_like` for `_nf4_tile`."""
    _nf4_pair_table_fill(cb_ptr, dtype, 0.0625)
    words_base = _nf4_pair_table_base(gl.zeros_like(words_like))
    lane = gl.inline_asm_elementwise(_LANE_OFFSET_ASM, "=r,r", [words_base], gl.int32, is_pure=True, pack=1)
    return lane, words_base


@gluon.jit
def _nf4_lane_entry(tables):
    """This lane's codebook entry from the 8 tables (`nf4.NF4_LANE_ASM`), shaped like them."""
    t0, t1, t2, t3, t4, t5, t6, t7 = tables
    return gl.inline_asm_elementwise(NF4_LANE_ASM, "=r,r,r,r,r,r,r,r,r", [t0, t1, t2, t3, t4, t5, t6, t7],
                                     gl.int32, is_pure=True, pack=1)


@gluon.jit
def _zero_pair(z16, dtype: gl.constexpr):
    """A group's two constants per row from z / 16 (`z16`, fp32), for the even and the odd nibbles
    (`_pair_planes_asm`): -(1024 / 16 + z / 16) and -(1024 / 256 + z / 16) in fp16, -(128 / 16 + z / 16) for both in
    bf16, so the dequantized value is (code - z) / 16, exact in either dtype."""
    base: gl.constexpr = 64.0 if dtype == gl.float16 else 8.0
    base16: gl.constexpr = 4.0 if dtype == gl.float16 else 8.0
    return (-(base + z16)).to(dtype)[:, None], (-(base16 + z16)).to(dtype)[:, None]


@gluon.jit
def _zero_consts(z_ptr, g, s_stride, rows, live, HAS_ZERO: gl.constexpr, dtype: gl.constexpr):
    """`_zero_pair` of group `g`'s zero points from global memory (8 when symmetric)."""
    if HAS_ZERO:
        z16 = gl.load(z_ptr + g * s_stride + rows, mask=live, other=0).to(gl.float32) * 0.0625
    else:
        z16 = gl.full([rows.shape[0]], 0.5, gl.float32, layout=rows.type.layout)
    return _zero_pair(z16, dtype)


@gluon.jit
def _zeros_at(z_ptr, z_ring, g, s_stride, rows, live, layout: gl.constexpr, dtype: gl.constexpr,
              FROM_RING: gl.constexpr):
    """`_zero_pair` of group `g`'s zero points: row g of the shared-memory ring, or group g in global memory."""
    if FROM_RING:
        return _zero_pair(z_ring.index(g).load(layout).to(gl.float32) * 0.0625, dtype)
    return _zero_consts(z_ptr, g, s_stride, rows, live, True, dtype)


@gluon.jit
def _dequant_tile(words, c0, c1, c2, c3, c4, c5, c6, c7):
    """The K-tile's 8 A operands ``[BLOCK_N, 16]`` (chunk j: columns 16 j ... 16 j + 15) from its words, in the
    constants' dtype."""
    return gl.inline_asm_elementwise(_pair_planes_asm(c0.dtype == gl.float16), _pair_planes_constraints(),
                                     [words, c0, c1, c2, c3, c4, c5, c6, c7],
                                     (c0.dtype, c0.dtype, c0.dtype, c0.dtype, c0.dtype, c0.dtype, c0.dtype, c0.dtype),
                                     is_pure=True, pack=2)


@gluon.jit
def _x_chunk(x_ptrs, m_ok, live, x_k, k_off, K, MASK_K: gl.constexpr):
    """x's B fragment of the 16 columns from `k_off` (zero past M, K or the split's last tile)."""
    if MASK_K:
        return gl.load(x_ptrs + k_off, mask=m_ok & live & ((k_off + x_k) < K)[:, None], other=0.0)
    return gl.load(x_ptrs + k_off, mask=m_ok & live, other=0.0)


@gluon.jit
def _x_global(x_ptrs, m_ok, live, x_k, k0, K, MASK_K: gl.constexpr):
    """A K-tile's 8 B fragments straight from global memory: two 4-byte loads per fragment and thread."""
    return (_x_chunk(x_ptrs, m_ok, live, x_k, k0, K, MASK_K), _x_chunk(x_ptrs, m_ok, live, x_k, k0 + 16, K, MASK_K),
            _x_chunk(x_ptrs, m_ok, live, x_k, k0 + 32, K, MASK_K), _x_chunk(x_ptrs, m_ok, live, x_k, k0 + 48, K, MASK_K),
            _x_chunk(x_ptrs, m_ok, live, x_k, k0 + 64, K, MASK_K), _x_chunk(x_ptrs, m_ok, live, x_k, k0 + 80, K, MASK_K),
            _x_chunk(x_ptrs, m_ok, live, x_k, k0 + 96, K, MASK_K),
            _x_chunk(x_ptrs, m_ok, live, x_k, k0 + 112, K, MASK_K))


@gluon.jit
def _x_shared(x_tile, layout: gl.constexpr):
    """A K-tile's 8 B fragments from its x ``[BLOCK_M, 128]`` in shared memory (rows contiguous along K, so each
    fragment is an `ldmatrix` of the transposed slice)."""
    return (x_tile.slice(0, 16, dim=1).permute((1, 0)).load(layout),
            x_tile.slice(16, 16, dim=1).permute((1, 0)).load(layout),
            x_tile.slice(32, 16, dim=1).permute((1, 0)).load(layout),
            x_tile.slice(48, 16, dim=1).permute((1, 0)).load(layout),
            x_tile.slice(64, 16, dim=1).permute((1, 0)).load(layout),
            x_tile.slice(80, 16, dim=1).permute((1, 0)).load(layout),
            x_tile.slice(96, 16, dim=1).permute((1, 0)).load(layout),
            x_tile.slice(112, 16, dim=1).permute((1, 0)).load(layout))


@gluon.jit
def _tile_mma(acc, xs, words, s_ptr, z_ptr, s_ring, z_ring, g_row, zlo, zhi, nf4_tables, nf4_lane, tile,
              i: gl.constexpr, live, rows, s_rows, s_stride, GROUP: gl.constexpr, PER_CHANNEL: gl.constexpr,
              HAS_ZERO: gl.constexpr, SCALE_RING: gl.constexpr, NF4: gl.constexpr, NF4_SHFL: gl.constexpr,
              NF4_SMEM: gl.constexpr):
    """One K-tile (tile `i` of its iteration) into `acc`: the 8 A operands from its words, and per chunk j one MMA
    with x's fragment j (`xs`, zero where not live); each scale group's sum scaled once. `zlo` / `zhi`: the zero
    constants when they are the same for every tile (per channel, symmetric). With SCALE_RING the iteration's
    scales and zero points come from the shared-memory rings (`s_ring` / `z_ring`: a row of BLOCK_N per group,
    the iteration's first at `g_row`), else from global memory. NF4: the operands are looked up in `nf4_tables`
    (NF4_SHFL of their halves by warp shuffles from this lane's entry, `nf4_lane`)."""
    dtype: gl.constexpr = xs[0].dtype
    z_layout: gl.constexpr = rows.type.layout
    s_layout: gl.constexpr = s_rows.type.layout
    # the tile's first scale group: in the ring's rows of this iteration, or in the weight's
    g0 = g_row + i * 128 // GROUP if SCALE_RING else tile * 128 // GROUP
    c0, c1, c2, c3, c4, c5, c6, c7 = zlo, zhi, zlo, zhi, zlo, zhi, zlo, zhi
    if HAS_ZERO and not PER_CHANNEL and not NF4:
        zlo, zhi = _zeros_at(z_ptr, z_ring, g0, s_stride, rows, live, z_layout, dtype, SCALE_RING)
        c0, c1, c2, c3, c4, c5, c6, c7 = zlo, zhi, zlo, zhi, zlo, zhi, zlo, zhi
        if GROUP == 64:
            zlo1, zhi1 = _zeros_at(z_ptr, z_ring, g0 + 1, s_stride, rows, live, z_layout, dtype, SCALE_RING)
            c4, c5, c6, c7 = zlo1, zhi1, zlo1, zhi1
        elif GROUP == 32:
            zlo1, zhi1 = _zeros_at(z_ptr, z_ring, g0 + 1, s_stride, rows, live, z_layout, dtype, SCALE_RING)
            zlo2, zhi2 = _zeros_at(z_ptr, z_ring, g0 + 2, s_stride, rows, live, z_layout, dtype, SCALE_RING)
            zlo3, zhi3 = _zeros_at(z_ptr, z_ring, g0 + 3, s_stride, rows, live, z_layout, dtype, SCALE_RING)
            c2, c3, c4, c5, c6, c7 = zlo1, zhi1, zlo2, zhi2, zlo3, zhi3
    if NF4:
        a = _nf4_tile(words, nf4_tables, nf4_lane, xs[0], NF4_SHFL, NF4_SMEM)
    else:
        a = _dequant_tile(words, c0, c1, c2, c3, c4, c5, c6, c7)
    part = gl.zeros_like(acc)
    for j in gl.static_range(8):
        if PER_CHANNEL:
            acc = mma_v2(a[j], xs[j], acc)
        else:
            part = mma_v2(a[j], xs[j], part)
            if (16 * (j + 1)) % GROUP == 0 or (j == 7 and GROUP > 128):  # a group's (or tile's) sum, scaled
                g = g0 + 16 * j // GROUP
                if SCALE_RING:
                    scale = s_ring.index(g).load(s_layout).to(gl.float32)
                else:
                    scale = gl.load(s_ptr + g * s_stride + s_rows, mask=live, other=0.0).to(gl.float32)
                acc += part * scale[:, None]
                part = gl.zeros_like(acc)
    return acc


@gluon.jit
def _ring_issue(w_slot, x_slot, s_ring, z_ring, g_row, w_src, w_cols, x_src, x_ok, x_k, s_src, z_src, it, tile0,
                tiles, K, s_stride, TILES: gl.constexpr, GROUP: gl.constexpr, HAS_ZERO: gl.constexpr,
                SCALE_RING: gl.constexpr):
    """Start the copies of iteration `it` (its TILES K-tiles from `tile0`) into one slot of the ring: the words
    ``[BLOCK_N, 16 x TILES]``, x ``[BLOCK_M, 128 x TILES]`` and with SCALE_RING the scales and zero points of
    its TILES x 128 / GROUP groups, a ring row each from `g_row`; zeros past the split's last tile (or past K,
    for x), and past the last iteration, where nothing is read."""
    t0 = it * TILES
    async_copy.async_copy_global_to_shared(w_slot, w_src + (tile0 + t0) * 16,
                                           mask=((t0 * 16 + w_cols) < tiles * 16)[None, :])
    k0 = (tile0 + t0) * 128
    async_copy.async_copy_global_to_shared(x_slot, x_src + k0,
                                           mask=x_ok & ((k0 + x_k) < K)[None, :] & ((t0 * 128 + x_k) < tiles * 128)[None, :])
    if SCALE_RING:
        for g in gl.static_range(TILES * 128 // GROUP):
            # one row per group: shared-memory views cannot be indexed down to rank 1 from a 2-D slot
            g_ok = t0 * 128 // GROUP + g < tiles * 128 // GROUP
            off = ((tile0 + t0) * 128 // GROUP + g) * s_stride
            async_copy.async_copy_global_to_shared(s_ring.index(g_row + g), s_src + off, mask=g_ok)
            if HAS_ZERO:
                async_copy.async_copy_global_to_shared(z_ring.index(g_row + g), z_src + off, mask=g_ok)


@gluon.jit
def _mma_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, cb_ptr, bias_ptr, out_ptr, M, N, K, num_tiles, per_split,
                     stride_xm, stride_qn, s_stride, stride_om, stride_split,
                     GROUP: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZERO: gl.constexpr, NF4: gl.constexpr,
                     HAS_BIAS: gl.constexpr,
                     PARTIAL: gl.constexpr, BLOCK_M: gl.constexpr, REPS: gl.constexpr, TILES: gl.constexpr,
                     MASK_K: gl.constexpr, X_SMEM: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
                     NF4_SHFL: gl.constexpr = 0, NF4_SMEM: gl.constexpr = False):
    """Program (token tile of BLOCK_M = 8, 16, 32 or 64, row tile of 16 x warps x REPS, K split): K-tiles
    [split * per_split, ...) of `num_tiles`, TILES of them per iteration (their loads issued together: long
    runs of each row per request burst, as the GEMV's many tiles per iteration); with PARTIAL the fp32 sums go to
    ``out[split]`` (``[splits, M, N]``, bias added by the reduction). X_SMEM: each iteration's x ``[BLOCK_M, 128 x
    TILES]`` by 16-byte loads into shared memory (two buffers, one barrier per iteration) and its B fragments by
    `ldmatrix`, instead of two 4-byte global loads per fragment and thread (their count was the kernel's cost,
    docs/design/w4a16.md E14). STAGES > 1 (x rows 16-byte aligned): a ring of STAGES slots filled by `cp.async`
    STAGES - 1 iterations ahead, holding the words, x and (groups of up to 128) the scales and zero points, so no
    load of an iteration waits in it (E15); the words then reach the A layout from shared memory. NF4: codes
    looked up in the codebook at `cb_ptr` (no zero points). PDL: as in `gemv._gemv_h2_kernel`."""
    WARPS: gl.constexpr = gl.num_warps()
    BLOCK_N: gl.constexpr = 16 * WARPS * REPS
    RING: gl.constexpr = STAGES > 1
    SCALE_RING: gl.constexpr = RING and not PER_CHANNEL and GROUP <= 128
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc_layout, k_width=2)
    off_m = gl.program_id(0) * BLOCK_M
    off_n = gl.program_id(1) * BLOCK_N
    split = gl.program_id(2)
    tile0 = split * per_split
    tiles = gl.minimum(per_split, num_tiles - tile0)
    if PDL:  # as `common._pdl_wait` (Triton's own griddepcontrol builtins run in Gluon too)
        tl.extra.cuda.gdc_wait()

    rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))
    words_cols = gl.arange(0, 16, layout=gl.SliceLayout(0, a_layout))
    w_ptrs = qw_ptr + rows.to(gl.int64)[:, None] * stride_qn + words_cols[None, :]
    x_k = gl.arange(0, 16, layout=gl.SliceLayout(1, b_layout))
    x_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, b_layout))
    x_ptrs = x_ptr + x_m.to(gl.int64)[None, :] * stride_xm + x_k[:, None]
    m_ok = (x_m < M)[None, :]
    s_rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
    zlo, zhi = _zero_consts(z_ptr, 0, s_stride, rows, True, HAS_ZERO and PER_CHANNEL, x_ptr.dtype.element_ty)
    nf4_tables = None
    nf4_lane = None
    if NF4 and NF4_SMEM:
        nf4_tables = _nf4_pair_table(cb_ptr, gl.zeros([BLOCK_N, 16], gl.int32, layout=a_layout), x_ptr.dtype.element_ty)
    elif NF4:
        nf4_tables = _nf4_tables(cb_ptr, gl.zeros([BLOCK_N, 16], gl.int32, layout=a_layout), x_ptr.dtype.element_ty,
                                 0.0625)
        if NF4_SHFL > 0:  # the lookup by warp shuffles reads this lane's entry
            nf4_lane = _nf4_lane_entry(nf4_tables)
    if X_SMEM or RING:
        # rows of 8 x values per thread (16-byte loads and stores), rows contiguous along K in shared memory
        xr_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
        x_shared: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
        xr_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xr_layout))
        xr_k = gl.arange(0, 128 * TILES, layout=gl.SliceLayout(0, xr_layout))
        xr_ptrs = x_ptr + xr_m.to(gl.int64)[:, None] * stride_xm + xr_k[None, :]
        xr_ok = (xr_m < M)[:, None]
    if RING:
        # words as 16-byte copies; in shared memory 16-byte units swizzled by row, so the A layout's 8-byte reads
        # of 8 rows fall in different banks
        wr_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [WARPS, 1], [1, 0])
        wr_rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wr_layout))
        wr_cols = gl.arange(0, 16 * TILES, layout=gl.SliceLayout(0, wr_layout))
        wr_ptrs = qw_ptr + wr_rows.to(gl.int64)[:, None] * stride_qn + wr_cols[None, :]
        w_ring = gl.allocate_shared_memory(qw_ptr.dtype.element_ty, [STAGES, BLOCK_N, 16 * TILES],
                                           gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0]))
        x_ring = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_M, 128 * TILES], x_shared)
        # scales and zero points: a row of BLOCK_N per group, GROUPS rows per slot
        GROUPS: gl.constexpr = TILES * 128 // GROUP if SCALE_RING else 1
        sr_n = off_n + gl.arange(0, BLOCK_N, layout=gl.BlockedLayout([8], [32], [WARPS], [0]))
        rows_1d: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        s_ring = gl.allocate_shared_memory(s_ptr.dtype.element_ty, [STAGES * GROUPS, BLOCK_N], rows_1d)
        z_ring = gl.allocate_shared_memory(z_ptr.dtype.element_ty, [STAGES * GROUPS, BLOCK_N], rows_1d)
        s_src = s_ptr + sr_n
        z_src = z_ptr + sr_n
        iters = (tiles + TILES - 1) // TILES
        for st in gl.static_range(STAGES - 1):
            _ring_issue(w_ring.index(st), x_ring.index(st), s_ring, z_ring, st * GROUPS, wr_ptrs, wr_cols,
                        xr_ptrs, xr_ok, xr_k, s_src, z_src, st, tile0, tiles, K, s_stride,
                        TILES, GROUP, HAS_ZERO, SCALE_RING)
            async_copy.commit_group()
        for it in range(0, iters):
            # iteration it's copies done (this thread's), then everyone's visible and everyone past iteration
            # it - 1, whose slot the next copies overwrite
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            nxt = it + STAGES - 1
            ns = nxt % STAGES
            _ring_issue(w_ring.index(ns), x_ring.index(ns), s_ring, z_ring, ns * GROUPS, wr_ptrs, wr_cols,
                        xr_ptrs, xr_ok, xr_k, s_src, z_src, nxt, tile0, tiles, K, s_stride,
                        TILES, GROUP, HAS_ZERO, SCALE_RING)
            async_copy.commit_group()
            slot = it % STAGES
            w_slot = w_ring.index(slot)
            x_slot = x_ring.index(slot)
            for i in gl.static_range(TILES):
                tile = tile0 + it * TILES + i
                live = it * TILES + i < tiles
                xs = _x_shared(x_slot.slice(128 * i, 128, dim=1), b_layout)
                words = w_slot.slice(16 * i, 16, dim=1).load(a_layout)
                acc = _tile_mma(acc, xs, words, s_ptr, z_ptr, s_ring, z_ring, slot * GROUPS, zlo, zhi, nf4_tables,
                                nf4_lane, tile, i, live, rows, s_rows, s_stride, GROUP, PER_CHANNEL, HAS_ZERO,
                                SCALE_RING, NF4, NF4_SHFL, NF4_SMEM)
        async_copy.wait_group(0)
    else:
        if X_SMEM:
            x_bufs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [2, BLOCK_M, 128 * TILES], x_shared)
        for it in range(0, tiles, TILES):
            if X_SMEM:
                # two buffers: a warp that reaches this store has passed the barrier after the other buffer's
                # store, so every warp is done reading this buffer from two iterations back
                buf = x_bufs.index((it // TILES) % 2)
                k0 = (tile0 + it) * 128
                ok = xr_ok & ((k0 + xr_k) < K)[None, :] & ((it * 128 + xr_k) < tiles * 128)[None, :]
                buf.store(gl.load(xr_ptrs + k0, mask=ok, other=0.0))
                gl.thread_barrier()
            for i in gl.static_range(TILES):
                tile = tile0 + it + i
                live = it + i < tiles
                if X_SMEM:
                    xs = _x_shared(buf.slice(128 * i, 128, dim=1), b_layout)
                else:
                    xs = _x_global(x_ptrs, m_ok, live, x_k, tile * 128, K, MASK_K)
                words = gl.load(w_ptrs + tile * 16, mask=live, other=0)
                acc = _tile_mma(acc, xs, words, s_ptr, z_ptr, None, None, 0, zlo, zhi, nf4_tables, nf4_lane, tile, i,
                                live, rows, s_rows, s_stride, GROUP, PER_CHANNEL, HAS_ZERO, False, NF4, NF4_SHFL,
                                NF4_SMEM)
    if PDL:  # the next kernel may launch (`common._pdl_launch_dependents`)
        tl.extra.cuda.gdc_launch_dependents()
    acc = acc * 16.0
    if PER_CHANNEL:
        acc = acc * gl.load(s_ptr + s_rows).to(gl.float32)[:, None]
    # a layout with consecutive output columns (weight rows) per thread, for wide stores
    out_layout: gl.constexpr = gl.BlockedLayout([4, 1], [8, 4], [WARPS, 1], [0, 1])
    result = gl.convert_layout(acc, out_layout)
    n_idx = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
    m_idx = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
    mask = (n_idx[:, None] < N) & (m_idx[None, :] < M)
    offsets = m_idx.to(gl.int64)[None, :] * stride_om + n_idx[:, None]
    if PARTIAL:
        gl.store(out_ptr + split.to(gl.int64) * stride_split + offsets, result, mask=mask)
    else:
        if HAS_BIAS:
            result = result + gl.load(bias_ptr + n_idx, mask=n_idx < N, other=0.0).to(gl.float32)[:, None]
        gl.store(out_ptr + offsets, result.to(out_ptr.dtype.element_ty), mask=mask)
