"""A tensor-core GEMV for decode (1-32 tokens) in Gluon: `mma.sync` (sm_80+) on operands built in registers
(the 2-32-token path of the H200 table and of `tuning.mma_heuristic`; docs/design/w4a16.md E14-E17).

The packed-fp16 GEMV spends ~4 instructions per weight (dequantization, then one HFMA2 per weight pair and per
token), about the H200's whole issue budget at copy bandwidth; the MMA makes the per-token work free. The K loop
(the int4 operands built in registers, x's fragments, the cp.async ring, the MMAs) is `mma_gemv._mma_acc`, shared
with moe-dispatch's 4-bit gate/up GEMV; this module holds the kernel around it and NF4's lookups.

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

from .mma_gemv import _mma_acc, mma_layout
from .nf4 import (_LANE_OFFSET_ASM, _NF4_FILL_ASM, NF4_LANE_ASM, _nf4_pair_table_base, nf4_pair_table_asm,
                  nf4_select_asm, nf4_shfl_pair_asm)


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
def _mma_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, cb_ptr, bias_ptr, out_ptr, M, N, K, num_tiles, per_split,
                     stride_xm, stride_qn, s_stride, stride_om, stride_split,
                     GROUP: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZERO: gl.constexpr, NF4: gl.constexpr,
                     HAS_BIAS: gl.constexpr,
                     PARTIAL: gl.constexpr, BLOCK_M: gl.constexpr, REPS: gl.constexpr, TILES: gl.constexpr,
                     MASK_K: gl.constexpr, X_SMEM: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
                     NF4_SHFL: gl.constexpr = 0, NF4_SMEM: gl.constexpr = False):
    """Program (token tile of BLOCK_M = 8, 16, 32 or 64, row tile of 16 x warps x REPS, K split): K-tiles
    [split * per_split, ...) of `num_tiles` by `mma_gemv._mma_acc` (X_SMEM, STAGES, TILES there); with PARTIAL the
    fp32 sums go to ``out[split]`` (``[splits, M, N]``, bias added by the reduction). NF4: codes looked up in the
    codebook at `cb_ptr` (`_nf4_tile`; no zero points). PDL: as in `gemv._gemv_h2_kernel`."""
    WARPS: gl.constexpr = gl.num_warps()
    BLOCK_N: gl.constexpr = 16 * WARPS * REPS
    a_layout: gl.constexpr = mma_layout(WARPS, 0)
    off_m = gl.program_id(0) * BLOCK_M
    off_n = gl.program_id(1) * BLOCK_N
    split = gl.program_id(2)
    tile0 = split * per_split
    tiles = gl.minimum(per_split, num_tiles - tile0)
    if PDL:  # as `common._pdl_wait` (Triton's own griddepcontrol builtins run in Gluon too)
        tl.extra.cuda.gdc_wait()
    nf4_tables = None
    nf4_lane = None
    if NF4 and NF4_SMEM:
        nf4_tables = _nf4_pair_table(cb_ptr, gl.zeros([BLOCK_N, 16], gl.int32, layout=a_layout), x_ptr.dtype.element_ty)
    elif NF4:
        nf4_tables = _nf4_tables(cb_ptr, gl.zeros([BLOCK_N, 16], gl.int32, layout=a_layout), x_ptr.dtype.element_ty,
                                 0.0625)
        if NF4_SHFL > 0:  # the lookup by warp shuffles reads this lane's entry
            nf4_lane = _nf4_lane_entry(nf4_tables)
    acc = _mma_acc(x_ptr, qw_ptr, s_ptr, z_ptr, off_m, M, K, off_n, 0, tile0, tiles, stride_xm, stride_qn, s_stride,
                   nf4_tables, nf4_lane, GROUP, PER_CHANNEL, HAS_ZERO, NF4, _nf4_tile, NF4_SHFL, NF4_SMEM, BLOCK_M,
                   REPS, TILES, MASK_K, X_SMEM, STAGES, False)
    if PDL:  # the next kernel may launch (`common._pdl_launch_dependents`)
        tl.extra.cuda.gdc_launch_dependents()
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
