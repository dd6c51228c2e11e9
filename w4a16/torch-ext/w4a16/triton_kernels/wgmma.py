"""The Hopper tensor-core matmul for M >= 256 in Gluon (the H100 table selects it at M = 256-4096 where it wins).

Triton's own pipeliner builds the dot path's operands on the warps that issue the MMA and overlaps nothing within
a program (`dot._dot_kernel`, docs/design/w4a16.md E2-E8); Triton 3.6's automatic warp specialization fails on
dequantization loops. Here a CTA is partitions sharing mbarrier rings:

- a loader warp brings each 128-column K-tile by TMA: the tile's packed words ``[BLOCK_N, 16]`` and x's
  ``[BLOCK_M, 128]`` (zero-filled past M and K), and with SCALES_TMA (plan "scales_tma", E54 / E80) the tile's
  group rows of scales, zero points and minima (one a group: 1, 2 or 4 a K-tile), which the consumers otherwise
  load themselves;
- one warpgroup per 128 rows of the tile (``block_n`` 128 or 256: one or two consumers) dequantizes each
  16-column K-chunk straight into the wgmma register operand (RS wgmma, weight rows as the MMA's M, tokens as its
  N) while the previous chunk's MMA runs, then writes ``out[M, N]`` (by TMA stores left in flight where it can,
  E50). Nibble j of word c is column ``16 j + c`` (`formats`), so chunk j is nibble j of the words, which a thread
  loads in the operand's own layout. A second warpgroup runs as a worker partition, pipelined only through
  `warp_specialize.unlooped_workers` (E40).

Programs are persistent, at most one an SM: each runs output blocks one after the other, its ring running on
from one block into the next, so the loader fills it with the next block's K-tiles while the consumers finish
the last one (E49).

Formats: int4 with scale groups of 32, 64 or multiples of 128, or per channel; integer zero points, symmetric
or float minima; NF4 (the codebook looked up in the shared-memory pair table or by byte permutes, `nf4`, two
chunks at a time); fp16 or bf16 activations. The dequantized operand is rounded to x's dtype once, as the
dequantize + cuBLAS path rounds it (`tuning.wgmma_supported` says where this kernel applies). A first version
with the operand made by warps of their own into a shared-memory ring (commit 55b12cc) measured slower."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .mma import _nf4_pair_table_fill, _nf4_tables
from .nf4 import nf4_lookup_asm, nf4_pair_table_asm, nf4_table_address_ptx
from .wgmma_chunks import _chain_step, _group_params, _group_stored, _opaque_zeros


@gluon.jit
def _block_at(block, schedule):
    """Output block `block` of the launch's (token tile, row tile, split) order, token tiles fastest (the programs
    running together share a row tile's words): its first token and row, split, first K-tile and K-tile count."""
    M, columns, num_tiles, per_split, BLOCK_M, BLOCK_N = schedule
    token_tiles = gl.cdiv(M, BLOCK_M)
    column = (block // token_tiles) % columns
    split = block // (token_tiles * columns)
    tile0 = split * per_split
    return (block % token_tiles) * BLOCK_M, column * BLOCK_N, split, tile0, gl.minimum(per_split, num_tiles - tile0)


@gluon.jit
def _block_count(schedule):
    M, columns, num_tiles, per_split, BLOCK_M, BLOCK_N = schedule
    return gl.cdiv(M, BLOCK_M) * columns * gl.cdiv(num_tiles, per_split)


@gluon.constexpr_function
def _stage_bytes(words, scales, zeros, minima, has_zero, has_min, scales_tma):
    """Bytes the words' barrier of a ring stage waits for. The flags must be compile-time bools: a flag that came
    as a tensor would count boxes that never arrive, and the barrier would never complete (a hang)."""
    if not all(isinstance(flag, bool) for flag in (has_zero, has_min, scales_tma)):
        raise TypeError(f"_stage_bytes: has_zero / has_min / scales_tma must be constexpr bools, got "
                        f"{[type(flag).__name__ for flag in (has_zero, has_min, scales_tma)]}")
    if not scales_tma:
        return words
    return words + scales + (zeros if has_zero else 0) + (minima if has_min else 0)


@gluon.jit
def _load_partition(ring, GROUP: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZERO: gl.constexpr,
                    HAS_MIN: gl.constexpr, SCALES_TMA: gl.constexpr):
    """The ring's producer: each K-tile's words (with SCALES_TMA its group's scales, zero points and minima
    beside them, on the words' barrier) and x's columns, by TMA. The flags come as arguments of their own, written
    out in the `warp_specialize` call: a tuple assigned to a variable in a jit function holds its constexprs as
    tensors, and a flag that is a tensor here would make `_stage_bytes` count boxes that never arrive."""
    w_desc, x_desc, w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, schedule, s_desc, z_desc, m_desc, s_bufs, \
        z_bufs, m_bufs = ring
    stages: gl.constexpr = w_bufs.type.shape[0]
    w_bytes: gl.constexpr = _stage_bytes(w_desc.block_type.nbytes, s_desc.block_type.nbytes, z_desc.block_type.nbytes,
                                         m_desc.block_type.nbytes, HAS_ZERO, HAS_MIN, SCALES_TMA)
    step = 0  # K-tiles loaded by this program so far, over all its blocks: the ring's position
    for block in range(gl.program_id(0), _block_count(schedule), gl.num_programs(0)):
        off_m, off_n, split, tile0, num_tiles = _block_at(block, schedule)
        for t in range(num_tiles):
            s = step % stages
            phase = (step // stages) & 1
            # Barriers start in phase 0 incomplete: waiting on the opposite parity passes the first round.
            mbarrier.wait(w_empty.index(s), phase ^ 1)
            mbarrier.expect(w_ready.index(s), w_bytes)
            tma.async_copy_global_to_shared(w_desc, [off_n, (tile0 + t) * 16], w_ready.index(s), w_bufs.index(s))
            if SCALES_TMA:  # the K-tile's group rows (one, or 128 // GROUP for groups of 32 / 64)
                g = 0 if PER_CHANNEL else (tile0 + t) * 128 // GROUP
                tma.async_copy_global_to_shared(s_desc, [g, off_n], w_ready.index(s), s_bufs.index(s))
                if HAS_ZERO:
                    tma.async_copy_global_to_shared(z_desc, [g, off_n], w_ready.index(s), z_bufs.index(s))
                if HAS_MIN:
                    tma.async_copy_global_to_shared(m_desc, [g, off_n], w_ready.index(s), m_bufs.index(s))
            mbarrier.wait(x_empty.index(s), phase ^ 1)
            mbarrier.expect(x_ready.index(s), x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [off_m, (tile0 + t) * 128], x_ready.index(s), x_bufs.index(s))
            step += 1


def _nf4_chunk_pairs_ptx(byte: int, smem: bool) -> list[str]:
    """PTX lines putting the fp16 codebook pairs of NF4 chunks j = 2 byte and j + 1 of two neighbouring words
    a = $2, b = $3 into p = (a_j, b_j) and q = (a_j+1, b_j+1), nibble j in the low half. By byte permutes: the
    words' bytes `byte` side by side (PRMT) are the codes (a_j, a_j+1, b_j, b_j+1), looked up at once in the
    codebook's fp16 tables at $4, $6, ..., $18 (`nf4`; an int32 input of a pack-2 asm takes an operand per
    element) and paired per chunk (PRMT). With `smem`, from the shared-memory pair table (`nf4.nf4_pair_table_asm`,
    filled by `mma._nf4_pair_table_fill`): byte `byte` of each word is the pair (x_j, x_j+1), and 2 PRMT regroup
    them; the lane and the table's address are read in the PTX (`nf4.nf4_table_address_ptx`)."""
    if smem:
        return [".reg .b32 a, l, t, pa, pb, p, q;", nf4_table_address_ptx().rstrip("\n"),
                nf4_pair_table_asm("$2", byte, "l", "t", "pa").rstrip("\n"),
                nf4_pair_table_asm("$3", byte, "l", "t", "pb").rstrip("\n"),
                "prmt.b32 p, pa, pb, 0x5410;", "prmt.b32 q, pa, pb, 0x7632;"]
    return [".reg .b32 t, s, x, la, lb, ha, hb, lo, hi, p, q;",
            f"prmt.b32 t, $2, $3, {byte | ((4 + byte) << 4):#x};", nf4_lookup_asm("t", 4, 2).rstrip("\n"),
            "prmt.b32 p, lo, hi, 0x6240;", "prmt.b32 q, lo, hi, 0x7351;"]


def _nf4_chunks_ptx(byte: int, half_scale: bool, is_fp16: bool, smem: bool) -> str:
    """PTX for NF4 chunks j = 2 byte and j + 1 of two neighbouring words a = $2, b = $3 (`_nf4_chunk_pairs_ptx`),
    scaled: with `half_scale` (fp16 x and scales) by one packed fp16 multiply with the scale pair, else each value
    in fp32 times the scale (two operands) and rounded once to x's dtype. The scale follows the tables ($20) or,
    with `smem`, the words ($4). The dequantize path's arithmetic (`nf4._nf4_pair_planes`). Outputs: $0 chunk j,
    $1 chunk j + 1, two operand values each."""
    scale = 4 if smem else 20
    lines = [*_nf4_chunk_pairs_ptx(byte, smem), ".reg .b16 h0, h1;", ".reg .f32 f0, f1;"]
    for out, pair in (("$0", "p"), ("$1", "q")):
        if half_scale:
            lines.append(f"mul.rn.f16x2 {out}, {pair}, ${scale};")
        else:
            lines += [f"mov.b32 {{h0, h1}}, {pair};", "cvt.f32.f16 f0, h0;", "cvt.f32.f16 f1, h1;",
                      f"mul.rn.f32 f0, f0, ${scale};", f"mul.rn.f32 f1, f1, ${scale + 1};",
                      f"cvt.rn.{'f16x2' if is_fp16 else 'bf16x2'}.f32 {out}, f1, f0;"]
    return "{\n" + "\n".join(lines) + "\n}"


# every variant built here, as Gluon's constexpr functions may not call plain Python functions
_NF4_CHUNKS_PTX = gl.constexpr({(byte, half_scale, is_fp16, smem): _nf4_chunks_ptx(byte, half_scale, is_fp16, smem)
                                for byte in range(4) for half_scale in (False, True) for is_fp16 in (False, True)
                                for smem in (False, True)})


@gluon.constexpr_function
def _nf4_chunks_asm(j, half_scale, is_fp16, smem):
    return _NF4_CHUNKS_PTX.value[(j // 2, half_scale, is_fp16, smem)]


@gluon.constexpr_function
def _nf4_chunks_constraints(half_scale, smem):
    return ",".join(["=r"] * 2 + ["r"] * (2 + (0 if smem else 16) + (1 if half_scale else 2)))


@gluon.jit
def _chain_stored(s_ptr, z_ptr, m_ptr, g, s_stride, rows, HAS_ZERO: gl.constexpr, HAS_MIN: gl.constexpr,
                  CHAINS: gl.constexpr):
    """Group g's stored parameters for the CHAINS 64-row chains from `rows` on (`_group_stored`; with one chain
    the pair is the first chain's twice)."""
    first = _group_stored(s_ptr, z_ptr, m_ptr, g, s_stride, rows, HAS_ZERO, HAS_MIN)
    if CHAINS == 2:
        return first, _group_stored(s_ptr, z_ptr, m_ptr, g, s_stride, rows + 64, HAS_ZERO, HAS_MIN)
    return first, first


@gluon.jit
def _chain_params(stored, HAS_ZERO: gl.constexpr, HAS_MIN: gl.constexpr, NF4: gl.constexpr, dtype: gl.constexpr):
    stored0, stored1 = stored
    return (_group_params(stored0, HAS_ZERO, HAS_MIN, NF4, dtype),
            _group_params(stored1, HAS_ZERO, HAS_MIN, NF4, dtype))


@gluon.jit
def _chain_stored_smem(s_buf, z_buf, m_buf, START: gl.constexpr, layout: gl.constexpr, HAS_ZERO: gl.constexpr,
                       HAS_MIN: gl.constexpr, CHAINS: gl.constexpr):
    """A group's parameters for the CHAINS 64-row chains whose first row is element START of the ring stage's
    flattened buffers (as `_chain_stored`), which the loader filled by TMA (SCALES_TMA): unswizzled, so a flat
    view of the ``[groups, BLOCK_N]`` box is the same bytes, row after row."""
    first = _row_stored_smem(s_buf, z_buf, m_buf, START, layout, HAS_ZERO, HAS_MIN)
    if CHAINS == 2:
        return first, _row_stored_smem(s_buf, z_buf, m_buf, START + 64, layout, HAS_ZERO, HAS_MIN)
    return first, first


@gluon.jit
def _tile_params_smem(s_buf, z_buf, m_buf, ROW0: gl.constexpr, layout: gl.constexpr, HAS_ZERO: gl.constexpr,
                      HAS_MIN: gl.constexpr, NF4: gl.constexpr, dtype: gl.constexpr, CHAINS: gl.constexpr):
    """Every group's converted parameters of the K-tile in the ring stage (`_chain_params`), one pair of chains'
    per group row of its box (1, 2 or 4): read right after the words' barrier, so the stage can go back to the
    loader before the tile's later groups are used (E80). Unused entries repeat the first."""
    groups: gl.constexpr = s_buf.type.shape[0]
    width: gl.constexpr = s_buf.type.shape[1]
    first = _chain_params(_chain_stored_smem(s_buf, z_buf, m_buf, ROW0, layout, HAS_ZERO, HAS_MIN, CHAINS),
                          HAS_ZERO, HAS_MIN, NF4, dtype)
    second = first
    third = first
    fourth = first
    if groups >= 2:
        second = _chain_params(_chain_stored_smem(s_buf, z_buf, m_buf, width + ROW0, layout, HAS_ZERO, HAS_MIN,
                                                  CHAINS), HAS_ZERO, HAS_MIN, NF4, dtype)
    if groups == 4:
        third = _chain_params(_chain_stored_smem(s_buf, z_buf, m_buf, 2 * width + ROW0, layout, HAS_ZERO, HAS_MIN,
                                                 CHAINS), HAS_ZERO, HAS_MIN, NF4, dtype)
        fourth = _chain_params(_chain_stored_smem(s_buf, z_buf, m_buf, 3 * width + ROW0, layout, HAS_ZERO, HAS_MIN,
                                                  CHAINS), HAS_ZERO, HAS_MIN, NF4, dtype)
    return first, second, third, fourth


@gluon.jit
def _row_stored_smem(s_buf, z_buf, m_buf, row: gl.constexpr, layout: gl.constexpr, HAS_ZERO: gl.constexpr,
                     HAS_MIN: gl.constexpr):
    scale = _flat(s_buf).slice(row, 64).load(layout)
    if HAS_ZERO:
        zero = _flat(z_buf).slice(row, 64).load(layout)
    else:
        zero = scale
    if HAS_MIN:
        minimum = _flat(m_buf).slice(row, 64).load(layout)
    else:
        minimum = scale
    return scale, zero, minimum


@gluon.jit
def _flat(buf):
    """A ``[groups, BLOCK_N]`` unswizzled buffer as the 1-D rows it holds, one after the other."""
    return buf._reinterpret(buf.dtype, [buf.type.shape[0] * buf.type.shape[1]], gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def _store_out(acc, bias_ptr, out_ptr, off_m, off_n, split, M, N, out_stride, HAS_BIAS: gl.constexpr,
               PARTIAL: gl.constexpr, dtype: gl.constexpr):
    """``out[m, n] = acc[n, m] (+ bias[n])``, or with PARTIAL the fp32 sums into ``out[split]``."""
    BLOCK_N: gl.constexpr = acc.type.shape[0]
    BLOCK_M: gl.constexpr = acc.type.shape[1]
    # a layout with 8 consecutive n per thread, for 16-byte stores
    out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, gl.num_warps()], [0, 1])
    result = gl.convert_layout(acc, out_layout)
    n_idx = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
    m_idx = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
    if HAS_BIAS and not PARTIAL:
        result = result + gl.load(bias_ptr + n_idx, mask=n_idx < N, other=0.0).to(gl.float32)[:, None]
    mask = (n_idx[:, None] < N) & (m_idx[None, :] < M)
    offsets = m_idx.to(gl.int64)[None, :] * out_stride + n_idx[:, None]
    if PARTIAL:
        gl.store(out_ptr + split.to(gl.int64) * M * N + offsets, result, mask=mask)
    else:
        gl.store(out_ptr + offsets, result.to(dtype), mask=mask)


@gluon.jit
def _store_tma(acc, c_buf, out_desc, bias_ptr, off_m, off_n, N, HAS_BIAS: gl.constexpr, CHAINS: gl.constexpr):
    """``out[m, n] = acc[n, m] (+ bias[n])`` through shared memory by a TMA store, left in flight: the tile is
    written straight from the accumulator's layout (no layout conversion) once the program's previous store from
    this buffer has read it. A consumer's chains store in turn from buffers of their own, so that store is the
    CHAINS-th last this warpgroup issued."""
    result = acc
    if HAS_BIAS:
        n_idx = off_n + gl.arange(0, acc.type.shape[0], layout=gl.SliceLayout(1, acc.type.layout))
        result = result + gl.load(bias_ptr + n_idx, mask=n_idx < N, other=0.0).to(gl.float32)[:, None]
    tma.store_wait(CHAINS - 1)
    c_buf.permute((1, 0)).store(result.to(c_buf.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [off_m, off_n], c_buf)


@gluon.jit
def _store_tma_partial(acc, c_pair, out_desc, row, col):
    """``out[row + m, col + n] = acc[n, m]`` (fp32 partial sums of a split) by two TMA stores of ``[BLOCK_M, 32]``
    (a 128-byte swizzled fp32 row holds 32 columns), left in flight: both chains of a consumer use the same pair of
    buffers, so each waits until the stores before it have read them."""
    BLOCK_M: gl.constexpr = acc.type.shape[1]
    tma.store_wait(0)
    # rows n < 32 then n >= 32 of acc, each as [BLOCK_M, 32]: in registers only a new layout, no data moved
    halves = gl.reshape(gl.permute(gl.reshape(acc, [2, 32, BLOCK_M]), (0, 2, 1)), [2 * BLOCK_M, 32])
    c_pair.store(halves)
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [row, col], c_pair.slice(0, BLOCK_M))
    tma.async_copy_shared_to_global(out_desc, [row, col + 32], c_pair.slice(BLOCK_M, BLOCK_M))


@gluon.jit
def _nf4_chunks(words, j: gl.constexpr, scale, tables, x_like, SMEM: gl.constexpr):
    """NF4 K-chunks j and j + 1 (j even) of one 64-row chain as two register operands in x's dtype (`x_like`,
    `_nf4_chunks_asm`): one lookup serves both, so chunk j + 1's operand is made a chunk early. The codebook from
    the PRMT `tables`, or with SMEM from the shared-memory pair table (`tables` unused)."""
    dtype = x_like.dtype
    half_scale: gl.constexpr = scale.dtype == gl.float16
    text: gl.constexpr = _nf4_chunks_asm(j, half_scale, dtype == gl.float16, SMEM)
    constraints: gl.constexpr = _nf4_chunks_constraints(half_scale, SMEM)
    if SMEM:
        operands = [words, scale[:, None]]
    else:
        t0, t1, t2, t3, t4, t5, t6, t7 = tables
        operands = [words, t0, t1, t2, t3, t4, t5, t6, t7, scale[:, None]]
    return gl.inline_asm_elementwise(text, constraints, operands, (dtype, dtype), is_pure=True, pack=2)


@gluon.jit
def _consumer_partition(operands, GROUP: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZERO: gl.constexpr,
                        HAS_MIN: gl.constexpr, NF4: gl.constexpr, NF4_SMEM: gl.constexpr, HAS_BIAS: gl.constexpr,
                        PARTIAL: gl.constexpr,
                        INFLIGHT: gl.constexpr, TMA_STORE: gl.constexpr, SCALES_TMA: gl.constexpr, CHAINS: gl.constexpr,
                        ROW0: gl.constexpr):
    """Dequantization into the MMA's register operand beside the previous chunk's asynchronous MMA, then the
    output. The words are loaded in the operand's own layout (a thread holds the words of the K columns its
    fragment needs: word c of a row is column 16 j + c of K-chunk j), so each 16-column chunk j is the words' nibble
    j, dequantized in place. A warpgroup's rows (from ROW0 in the tile) run as CHAINS 64-row chains with
    accumulators of their own: one operand of several MMA repetitions made ptxas serialize every wgmma (C7515,
    "non wgmma instructions defining accumulator registers"); separate chains do not (docs/design/w4a16.md E12,
    E13). One chain of a 256-token tile (E55) makes each dequantized operand feed an MMA twice as long. As a worker
    partition it pipelines only with its accumulators zeroed by `_opaque_zeros` and its PTX edited
    (`warp_specialize`, E40). INFLIGHT (1, 2 or 3): the chunks whose MMAs may still run when the next chunk's
    dequantization starts; each keeps its operand registers live until the wait that retires it. NF4 makes the
    operands of chunks j and j + 1 at even j (`_nf4_chunks`)."""
    (w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, s_ptr, z_ptr, m_ptr, cb_ptr, bias_ptr, out_ptr, out_desc,
     c_bufs, s_bufs, z_bufs, m_bufs, schedule, N, s_stride, out_stride) = operands
    stages: gl.constexpr = w_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = x_bufs.type.shape[1]
    M = schedule[0]
    dtype: gl.constexpr = x_bufs.dtype
    TWO: gl.constexpr = CHAINS == 2
    consumer: gl.constexpr = ROW0 // (64 * CHAINS)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    prev0 = gl.zeros([64, 16], dtype, layout=a_layout)
    older0 = gl.zeros([64, 16], dtype, layout=a_layout)
    oldest0 = gl.zeros([64, 16], dtype, layout=a_layout)
    if TWO:
        prev1 = gl.zeros([64, 16], dtype, layout=a_layout)
        older1 = gl.zeros([64, 16], dtype, layout=a_layout)
        oldest1 = gl.zeros([64, 16], dtype, layout=a_layout)
    tables = 0
    if NF4 and not NF4_SMEM:  # (the pair table was filled before the partitions split)
        tables = _nf4_tables(cb_ptr, gl.zeros([64, 16], gl.int32, layout=a_layout), gl.float16, 1.0)
    one_group: gl.constexpr = PER_CHANNEL or GROUP >= 128
    step = 0  # K-tiles consumed by this program so far, over all its blocks: the ring's position
    for block in range(gl.program_id(0), _block_count(schedule), gl.num_programs(0)):
        off_m, off_n, split, tile0, num_tiles = _block_at(block, schedule)
        rows = off_n + ROW0 + gl.arange(0, 64, layout=gl.SliceLayout(1, a_layout))
        acc0 = _opaque_zeros([64, BLOCK_M], acc_layout)
        if TWO:
            acc1 = _opaque_zeros([64, BLOCK_M], acc_layout)
        for t in range(num_tiles):
            tile = tile0 + t
            if one_group and not SCALES_TMA:  # issued before the barrier waits, so its latency overlaps them
                params0, params1 = _chain_params(
                    _chain_stored(s_ptr, z_ptr, m_ptr, 0 if PER_CHANNEL else tile * 128 // GROUP, s_stride, rows,
                                  HAS_ZERO, HAS_MIN, CHAINS), HAS_ZERO, HAS_MIN, NF4, dtype)
            s = step % stages
            phase = (step // stages) & 1
            mbarrier.wait(w_ready.index(s), phase)
            if SCALES_TMA:  # brought with the words: every group of the K-tile
                tile_params = _tile_params_smem(s_bufs.index(s), z_bufs.index(s), m_bufs.index(s), ROW0,
                                                gl.SliceLayout(1, a_layout), HAS_ZERO, HAS_MIN, NF4, dtype, CHAINS)
                params0, params1 = tile_params[0]
            words0 = w_bufs.index(s).slice(ROW0, 64, dim=0).load(a_layout)
            if TWO:
                words1 = w_bufs.index(s).slice(ROW0 + 64, 64, dim=0).load(a_layout)
            mbarrier.wait(x_ready.index(s), phase)
            x_tile = x_bufs.index(s)
            for j in gl.static_range(8):
                if not one_group and (16 * j) % GROUP == 0:  # the next group's parameters
                    if SCALES_TMA:
                        params0, params1 = tile_params[(16 * j) // GROUP]
                    else:
                        params0, params1 = _chain_params(
                            _chain_stored(s_ptr, z_ptr, m_ptr, (tile * 128 + 16 * j) // GROUP, s_stride, rows,
                                          HAS_ZERO, HAS_MIN, CHAINS), HAS_ZERO, HAS_MIN, NF4, dtype)
                x_chunk = x_tile.slice(16 * j, 16, dim=1).permute((1, 0))
                if NF4:
                    if j % 2 == 0:  # (j + 1's operands are kept for the next chunk)
                        a0, next0 = _nf4_chunks(words0, j, params0, tables, x_chunk, NF4_SMEM)
                        if TWO:
                            a1, next1 = _nf4_chunks(words1, j, params1, tables, x_chunk, NF4_SMEM)
                    else:
                        a0 = next0
                        if TWO:
                            a1 = next1
                    acc0 = warpgroup_mma(a0, x_chunk, acc0, is_async=True)
                    if TWO:
                        acc1 = warpgroup_mma(a1, x_chunk, acc1, is_async=True)
                else:
                    a0, acc0 = _chain_step(words0, j, params0, acc0, x_chunk)
                    if TWO:
                        a1, acc1 = _chain_step(words1, j, params1, acc1, x_chunk)
                # retires the chunk INFLIGHT before this one, whose operand registers stay live until here; when
                # that is the previous K-tile's last chunk, its x slot goes back to the loader
                if TWO:
                    if INFLIGHT == 1:
                        acc0, acc1, prev0, prev1 = warpgroup_mma_wait(num_outstanding=2,
                                                                      deps=(acc0, acc1, prev0, prev1))
                    elif INFLIGHT == 2:
                        acc0, acc1, older0, older1 = warpgroup_mma_wait(num_outstanding=4,
                                                                        deps=(acc0, acc1, older0, older1))
                        older0 = prev0
                        older1 = prev1
                    else:
                        acc0, acc1, oldest0, oldest1 = warpgroup_mma_wait(num_outstanding=6,
                                                                          deps=(acc0, acc1, oldest0, oldest1))
                        oldest0 = older0
                        oldest1 = older1
                        older0 = prev0
                        older1 = prev1
                else:
                    if INFLIGHT == 1:
                        acc0, prev0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, prev0))
                    elif INFLIGHT == 2:
                        acc0, older0 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, older0))
                        older0 = prev0
                    else:
                        acc0, oldest0 = warpgroup_mma_wait(num_outstanding=3, deps=(acc0, oldest0))
                        oldest0 = older0
                        older0 = prev0
                if j == INFLIGHT - 1:
                    # the words' slot goes back here, not right after their loads: by now those loads and the group
                    # parameters' have landed, so the release waits for neither (E45)
                    fence_async_shared()
                    mbarrier.arrive(w_empty.index(s), count=1)
                    mbarrier.arrive(x_empty.index((step + stages - 1) % stages), count=1, pred=t > 0)
                prev0 = a0
                if TWO:
                    prev1 = a1
            step += 1
        if TWO:
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        else:
            acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0,))
        # the block's last x slot back to the loader, which may be filling the ring for this program's next block
        mbarrier.arrive(x_empty.index((step + stages - 1) % stages), count=1, pred=num_tiles > 0)
        if TMA_STORE and PARTIAL:  # split parts' rows of M rounded up to whole token tiles
            row = split * gl.cdiv(M, BLOCK_M) * BLOCK_M + off_m
            _store_tma_partial(acc0, c_bufs.index(consumer), out_desc, row, off_n + ROW0)
            if TWO:
                _store_tma_partial(acc1, c_bufs.index(consumer), out_desc, row, off_n + ROW0 + 64)
        elif TMA_STORE:
            _store_tma(acc0, c_bufs.index(ROW0 // 64), out_desc, bias_ptr, off_m, off_n + ROW0, N, HAS_BIAS, CHAINS)
            if TWO:
                _store_tma(acc1, c_bufs.index(ROW0 // 64 + 1), out_desc, bias_ptr, off_m, off_n + ROW0 + 64, N,
                           HAS_BIAS, CHAINS)
        else:
            _store_out(acc0, bias_ptr, out_ptr, off_m, off_n + ROW0, split, M, N, out_stride, HAS_BIAS, PARTIAL,
                       dtype)
            if TWO:
                _store_out(acc1, bias_ptr, out_ptr, off_m, off_n + ROW0 + 64, split, M, N, out_stride, HAS_BIAS,
                           PARTIAL, dtype)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _wgmma_kernel(x_desc, w_desc, s_desc, z_desc, m_desc, s_ptr, z_ptr, m_ptr, cb_ptr, bias_ptr, out_ptr, out_desc,
                  M, N, columns, num_tiles, per_split, s_stride, out_stride, GROUP: gl.constexpr,
                  PER_CHANNEL: gl.constexpr, HAS_ZERO: gl.constexpr, HAS_MIN: gl.constexpr, NF4: gl.constexpr,
                  HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr, STAGES: gl.constexpr, INFLIGHT: gl.constexpr,
                  TMA_STORE: gl.constexpr, SCALES_TMA: gl.constexpr, CHAINS: gl.constexpr,
                  NF4_SMEM: gl.constexpr = False):
    """Output blocks (token tile, row tile of 128 or 256 of `columns`, K split) from `program_id` on, a grid apart
    (persistent programs); a block runs K-tiles [split * per_split, ...) of `num_tiles`; with PARTIAL its fp32
    partial sums go to ``out[split]`` (``[splits, M, N]``, bias added by the reduction), else its output is stored
    through `out_ptr`, or with TMA_STORE through `out_desc` (`_store_tma`; with PARTIAL `_store_tma_partial` into
    parts padded to whole token tiles). A consumer warpgroup per CHAINS 64-row chains (the first the default
    partition, a second a worker) and the loader warp, whose ring runs on across a program's blocks; INFLIGHT chunks
    of MMAs run beside the next chunk's dequantization. SCALES_TMA: the K-tile's group parameters come with its
    words through `s_desc` / `z_desc` / `m_desc` (one group a K-tile), not through `s_ptr` / `z_ptr` / `m_ptr`.
    NF4_SMEM: NF4 from the shared-memory pair table (linked in by the launch's extern_libs), filled here by the
    default partition's warps before the partitions split, so every consumer finds it filled."""
    if NF4 and NF4_SMEM:
        _nf4_pair_table_fill(cb_ptr, gl.float16, 1.0)
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    schedule = (M, columns, num_tiles, per_split, BLOCK_M, BLOCK_N)

    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumers: gl.constexpr = BLOCK_N // (64 * CHAINS)
    for i in gl.static_range(STAGES):
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=consumers)
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(x_empty.index(i), count=consumers)
    if TMA_STORE and PARTIAL:  # per consumer two [BLOCK_M, 32] fp32 halves of a chain, as out_desc's block
        c_bufs = gl.allocate_shared_memory(gl.float32, [consumers, 2 * BLOCK_M, 32], out_desc.layout)
    elif TMA_STORE:  # per 64-row chain a [BLOCK_M, 64] output tile (out_desc's block)
        c_bufs = gl.allocate_shared_memory(dtype, [BLOCK_N // 64] + out_desc.block_type.shape, out_desc.layout)
    else:
        c_bufs = w_bufs
    if SCALES_TMA:  # per stage the K-tile's group row of scales, zero points, minima ([1, BLOCK_N] boxes)
        s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
        z_bufs = s_bufs
        m_bufs = s_bufs
        if HAS_ZERO:
            z_bufs = gl.allocate_shared_memory(z_desc.dtype, [STAGES] + z_desc.block_type.shape, z_desc.layout)
        if HAS_MIN:
            m_bufs = gl.allocate_shared_memory(m_desc.dtype, [STAGES] + m_desc.block_type.shape, m_desc.layout)
    else:
        s_bufs = w_bufs
        z_bufs = w_bufs
        m_bufs = w_bufs
    operands = (w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, s_ptr, z_ptr, m_ptr, cb_ptr, bias_ptr, out_ptr,
                out_desc, c_bufs, s_bufs, z_bufs, m_bufs, schedule, N, s_stride, out_stride)
    ring = (w_desc, x_desc, w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, schedule, s_desc, z_desc, m_desc,
            s_bufs, z_bufs, m_bufs)
    if consumers == 2:
        # the worker's wgmma pipeline only in PTX edited by `warp_specialize.unlooped_workers` (the launcher's)
        gl.warp_specialize([
            (_consumer_partition,
             (operands, GROUP, PER_CHANNEL, HAS_ZERO, HAS_MIN, NF4, NF4_SMEM, HAS_BIAS, PARTIAL, INFLIGHT, TMA_STORE,
              SCALES_TMA, CHAINS, 0)),
            (_consumer_partition,
             (operands, GROUP, PER_CHANNEL, HAS_ZERO, HAS_MIN, NF4, NF4_SMEM, HAS_BIAS, PARTIAL, INFLIGHT, TMA_STORE,
              SCALES_TMA, CHAINS, 64 * CHAINS)),
            (_load_partition, (ring, GROUP, PER_CHANNEL, HAS_ZERO, HAS_MIN, SCALES_TMA)),
        ], [4, 1], [232, 24])
    else:
        gl.warp_specialize([
            (_consumer_partition,
             (operands, GROUP, PER_CHANNEL, HAS_ZERO, HAS_MIN, NF4, NF4_SMEM, HAS_BIAS, PARTIAL, INFLIGHT, TMA_STORE,
              SCALES_TMA, CHAINS, 0)),
            (_load_partition, (ring, GROUP, PER_CHANNEL, HAS_ZERO, HAS_MIN, SCALES_TMA)),
        ], [1], [24])
