"""The grouped expert GEMMs of 4-bit experts on Hopper in Gluon: dequantization overlapped with asynchronous wgmma.

The Triton-language grouped kernels (`experts._gate_up_grouped_kernel` / `_down_grouped_kernel` with QUANT) make
each K-tile's operand on the warps that then wait for its MMA, so dequantization and MMA run in series; the
dequantize-first path instead moves every expert's 16-bit weights through memory. Here, as in w4a16's wgmma kernel
(whose design page, docs/design/w4a16.md E39-E51, measured each choice), a CTA is three partitions sharing mbarrier
rings:

- a loader warp brings each 128-column K-tile by TMA: two ``[128, 16]`` boxes of the expert's packed words (gate
  rows and their up rows ``second`` further for the gate / up GEMM, two neighbouring 128-row blocks for the down
  GEMM) and the token tile's ``[BLOCK_M, 128]`` activations (zero-filled past K);
- two warpgroups, each with two 64-row chains, dequantize each 16-column K-chunk straight into the wgmma register
  operand (weight rows as the MMA's M, tokens as its N) while the previous chunks' MMAs run. The second warpgroup
  is a worker partition, pipelined only in the PTX `warp_specialize.unlooped_workers` edits.

Blocks are (token tile of the pairs sorted by expert, row tile) with token tiles fastest; programs are persistent,
one an SM, and skip unused token tiles (expert -1). The gate / up GEMM's chains of a warpgroup are 64 gate rows
and the same 64 up rows, so its epilogue is SiLU(gate) * up in fp32, stored by TMA into the intermediate's sorted
rows. The down GEMM's output, times each row's routing weight, goes by TMA stores into sorted rows as well, which
the combine reads through each pair's sorted row (E57; the stores leave the accumulator's layout as it is, w4a16
E50). The activations of the gate / up GEMM are the token rows in sorted order (`experts._gather_rows_kernel`: TMA
cannot gather rows on Hopper); the down GEMM reads the intermediate as it is.

Formats: int4 with scale groups of 32, 64, multiples of 128 or per channel; integer zero points, symmetric or
float minima; fp16 or bf16 activations. The operand is made in x's dtype (``(v - shift) * scale + addend`` on pairs
of values) and the scales rounded to it, as w4a16's wgmma kernel does; NF4 runs the Triton-language path.
Worker partitions' compile-time flags are written out in the `warp_specialize` call: a tuple assigned in a jit
function holds its constexprs as tensors (w4a16 run 141)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma_wait,
)

from .wgmma_chunks import _chain_step, _group_params, _group_stored, _opaque_zeros

# inflight MMAs a chain keeps running while the next chunk's operand is made (w4a16's shipped `inflight` 2)
_INFLIGHT = gl.constexpr(2)


@gluon.jit
def _block_at(block, schedule):
    """Block `block` of the launch, token tiles fastest (programs running together share an expert's row tile):
    its token tile, first token row and first output column."""
    max_blocks, BLOCK_M, BLOCK_N = schedule
    tile = block % max_blocks
    return tile, tile * BLOCK_M, (block // max_blocks) * BLOCK_N


@gluon.jit
def _load_partition(ring):
    """The ring's producer: per K-tile the two word boxes of the block's expert and the token tile's activations,
    by TMA. Unused token tiles are skipped, as the consumers skip them."""
    w_desc, x_desc, w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, block_expert_ptr, schedule, blocks, \
        num_tiles, rows_per_expert, second = ring
    stages: gl.constexpr = x_bufs.type.shape[0]
    step = 0  # K-tiles loaded by this program so far, over all its blocks: the ring's position
    for block in range(gl.program_id(0), blocks, gl.num_programs(0)):
        tile, off_m, off_n = _block_at(block, schedule)
        expert = gl.load(block_expert_ptr + tile)
        if expert >= 0:
            row = expert * rows_per_expert + off_n
            for t in range(num_tiles):
                s = step % stages
                phase = (step // stages) & 1
                # barriers start in phase 0 incomplete: waiting on the opposite parity passes the first round
                mbarrier.wait(w_empty.index(s), phase ^ 1)
                mbarrier.expect(w_ready.index(s), 2 * w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [row, t * 16], w_ready.index(s), w_bufs.index(2 * s))
                tma.async_copy_global_to_shared(w_desc, [row + second, t * 16], w_ready.index(s),
                                                w_bufs.index(2 * s + 1))
                mbarrier.wait(x_empty.index(s), phase ^ 1)
                mbarrier.expect(x_ready.index(s), x_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [off_m, t * 128], x_ready.index(s), x_bufs.index(s))
                step += 1


@gluon.jit
def _params(s_ptr, z_ptr, m_ptr, g, s_stride, rows, HAS_ZERO: gl.constexpr, HAS_MIN: gl.constexpr,
            dtype: gl.constexpr):
    """(scale, shift, addend) of group g for `rows` (`wgmma_chunks._group_params` of int4)."""
    return _group_params(_group_stored(s_ptr, z_ptr, m_ptr, g, s_stride, rows, HAS_ZERO, HAS_MIN), HAS_ZERO, HAS_MIN,
                         False, dtype)


@gluon.jit
def _row_weights(sorted_ids_ptr, topk_w_ptr, off_m, num_pairs, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """The routing weight of each sorted row off_m + m in fp32 (0 at padding), in `layout`."""
    pairs = gl.load(sorted_ids_ptr + off_m + gl.arange(0, BLOCK_M, layout=layout))
    return gl.load(topk_w_ptr + pairs, mask=pairs < num_pairs, other=0.0).to(gl.float32)


@gluon.jit
def _store_tma(act, c_buf, out_desc, off_m, col, PENDING: gl.constexpr):
    """``out[off_m + m, col + n] = act[n, m]`` through shared memory by a TMA store left in flight, once this
    warpgroup's previous store from the buffer has read it: the PENDING stores it issued since, from buffers of
    their own, may still run (no layout conversion: the accumulator's own layout)."""
    tma.store_wait(PENDING)
    c_buf.permute((1, 0)).store(act.to(c_buf.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [off_m, col], c_buf)


@gluon.jit
def _consumer_partition(operands, GROUP: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZERO: gl.constexpr,
                        HAS_MIN: gl.constexpr, SWIGLU: gl.constexpr, CONSUMER: gl.constexpr):
    """Warpgroup CONSUMER's two 64-row chains: dequantization into the MMA's register operand beside the previous
    chunks' asynchronous MMAs, then the epilogue. SWIGLU: chain 0 is gate rows ``64 CONSUMER..`` of the tile
    (first word box), chain 1 the same up rows (second box), and the output is SiLU(gate) * up at intermediate
    columns ``off_n + 64 CONSUMER``; else the chains are rows 0-63 and 64-127 of box CONSUMER, output columns
    ``off_n + 128 CONSUMER`` on, weighted. The chains keep accumulators of their own: one operand of several MMA
    repetitions made ptxas serialize every wgmma (w4a16 E12 / E13)."""
    (w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, s_ptr, z_ptr, m_ptr, block_expert_ptr, sorted_ids_ptr,
     topk_w_ptr, out_desc, c_bufs, schedule, blocks, num_tiles, rows_per_expert, second, s_stride_e, s_stride_g,
     num_pairs) = operands
    stages: gl.constexpr = x_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = x_bufs.type.shape[1]
    dtype: gl.constexpr = x_bufs.dtype
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, a_layout)
    if SWIGLU:  # (word box, first row in it) of each chain, and the weight row offset of chain 1 beyond chain 0
        box0: gl.constexpr = 0
        box1: gl.constexpr = 1
        row0: gl.constexpr = 64 * CONSUMER
        row1: gl.constexpr = 64 * CONSUMER
    else:
        box0: gl.constexpr = CONSUMER
        box1: gl.constexpr = CONSUMER
        row0: gl.constexpr = 0
        row1: gl.constexpr = 64
    older0 = gl.zeros([64, 16], dtype, layout=a_layout)
    older1 = gl.zeros([64, 16], dtype, layout=a_layout)
    prev0 = gl.zeros([64, 16], dtype, layout=a_layout)
    prev1 = gl.zeros([64, 16], dtype, layout=a_layout)
    one_group: gl.constexpr = PER_CHANNEL or GROUP >= 128
    step = 0  # K-tiles consumed by this program so far, over all its blocks: the ring's position
    for block in range(gl.program_id(0), blocks, gl.num_programs(0)):
        tile, off_m, off_n = _block_at(block, schedule)
        expert = gl.load(block_expert_ptr + tile)
        if expert >= 0:
            # the chains' weight rows within the expert, kept inside it (rows past the matrix feed only outputs
            # that are never stored)
            if SWIGLU:
                rows0 = off_n + 64 * CONSUMER + gl.arange(0, 64, layout=row_layout)
                rows1 = rows0 + second
            else:
                rows0 = off_n + 128 * CONSUMER + gl.arange(0, 64, layout=row_layout)
                rows1 = rows0 + 64
            rows0 = gl.minimum(rows0, rows_per_expert - 1)
            rows1 = gl.minimum(rows1, rows_per_expert - 1)
            base = expert.to(gl.int64) * s_stride_e
            s_e = s_ptr + base
            z_e = z_ptr + base
            m_e = m_ptr + base
            acc0 = _opaque_zeros([64, BLOCK_M], acc_layout)
            acc1 = _opaque_zeros([64, BLOCK_M], acc_layout)
            for t in range(num_tiles):
                if one_group:  # issued before the barrier waits, so its latency overlaps them
                    g = 0 if PER_CHANNEL else t * 128 // GROUP
                    params0 = _params(s_e, z_e, m_e, g, s_stride_g, rows0, HAS_ZERO, HAS_MIN, dtype)
                    params1 = _params(s_e, z_e, m_e, g, s_stride_g, rows1, HAS_ZERO, HAS_MIN, dtype)
                s = step % stages
                phase = (step // stages) & 1
                mbarrier.wait(w_ready.index(s), phase)
                words0 = w_bufs.index(2 * s + box0).slice(row0, 64, dim=0).load(a_layout)
                words1 = w_bufs.index(2 * s + box1).slice(row1, 64, dim=0).load(a_layout)
                mbarrier.wait(x_ready.index(s), phase)
                x_tile = x_bufs.index(s)
                for j in gl.static_range(8):
                    if not one_group and (16 * j) % GROUP == 0:
                        g = (t * 128 + 16 * j) // GROUP
                        params0 = _params(s_e, z_e, m_e, g, s_stride_g, rows0, HAS_ZERO, HAS_MIN, dtype)
                        params1 = _params(s_e, z_e, m_e, g, s_stride_g, rows1, HAS_ZERO, HAS_MIN, dtype)
                    x_chunk = x_tile.slice(16 * j, 16, dim=1).permute((1, 0))
                    a0, acc0 = _chain_step(words0, j, params0, acc0, x_chunk)
                    a1, acc1 = _chain_step(words1, j, params1, acc1, x_chunk)
                    # retires the chunk two before this one, whose operand registers stay live until here; when
                    # that is the previous K-tile's last chunk, its x slot goes back to the loader
                    acc0, acc1, older0, older1 = warpgroup_mma_wait(num_outstanding=2 * _INFLIGHT,
                                                                    deps=(acc0, acc1, older0, older1))
                    older0 = prev0
                    older1 = prev1
                    if j == _INFLIGHT - 1:
                        # the words' slot goes back once their loads and the parameters' have landed (w4a16 E45)
                        fence_async_shared()
                        mbarrier.arrive(w_empty.index(s), count=1)
                        mbarrier.arrive(x_empty.index((step + stages - 1) % stages), count=1, pred=t > 0)
                    prev0 = a0
                    prev1 = a1
                step += 1
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            # the block's last x slot back to the loader, which may be filling the ring for the next block
            mbarrier.arrive(x_empty.index((step + stages - 1) % stages), count=1, pred=num_tiles > 0)
            if SWIGLU:
                _store_tma(acc0 / (1.0 + gl.exp(-acc0)) * acc1, c_bufs.index(CONSUMER), out_desc, off_m,
                           off_n + 64 * CONSUMER, 0)
            else:  # each chain from a buffer of its own: a chain waits only for its own last store
                weight = _row_weights(sorted_ids_ptr, topk_w_ptr, off_m, num_pairs, BLOCK_M,
                                      gl.SliceLayout(0, acc_layout))[None, :]
                col = off_n + 128 * CONSUMER
                _store_tma(acc0 * weight, c_bufs.index(2 * CONSUMER), out_desc, off_m, col, 1)
                _store_tma(acc1 * weight, c_bufs.index(2 * CONSUMER + 1), out_desc, off_m, col + 64, 1)
    tma.store_wait(0)


@gluon.jit
def _grouped_wgmma_kernel(x_desc, w_desc, s_ptr, z_ptr, m_ptr, block_expert_ptr, sorted_ids_ptr, topk_w_ptr,
                          out_desc, max_blocks, columns, num_tiles, rows_per_expert, second, s_stride_e, s_stride_g,
                          num_pairs, GROUP: gl.constexpr, PER_CHANNEL: gl.constexpr,
                          HAS_ZERO: gl.constexpr, HAS_MIN: gl.constexpr, SWIGLU: gl.constexpr,
                          STAGES: gl.constexpr):
    """Blocks (token tile of `max_blocks`, output column tile of `columns`) from `program_id` on, a grid apart;
    a block runs all `num_tiles` K-tiles of its expert (``block_expert[tile]``, -1: skipped). Words: `w_desc` over
    all experts' rows (``rows_per_expert`` each), boxes of 128 rows; `second` rows from a block's first box to its
    second (SWIGLU: the up rows, I; else 128). Group parameters ``[E, G, Np]`` by pointer (`s_stride_e`,
    `s_stride_g`). SWIGLU: SiLU(gate) * up of 128 intermediate columns a block, into the sorted rows through
    `out_desc`; else 256 output columns a block, scattered to ``out_ptr[pair]`` (`out_stride`, `n_out` columns)
    times ``topk_w[pair]``."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BOX: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    if SWIGLU:  # output columns a block
        BLOCK_N: gl.constexpr = BOX
    else:
        BLOCK_N: gl.constexpr = 2 * BOX
    schedule = (max_blocks, BLOCK_M, BLOCK_N)
    blocks = max_blocks * columns

    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [2 * STAGES] + w_desc.block_type.shape, w_desc.layout)
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=2)
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(x_empty.index(i), count=2)
    # per 64-row output chain a [BLOCK_M, 64] tile (out_desc's block): one a warpgroup with SWIGLU, else two
    c_bufs = gl.allocate_shared_memory(dtype, [2 if SWIGLU else 4] + out_desc.block_type.shape, out_desc.layout)
    operands = (w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, s_ptr, z_ptr, m_ptr, block_expert_ptr,
                sorted_ids_ptr, topk_w_ptr, out_desc, c_bufs, schedule, blocks, num_tiles, rows_per_expert, second,
                s_stride_e, s_stride_g, num_pairs)
    ring = (w_desc, x_desc, w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, block_expert_ptr, schedule, blocks,
            num_tiles, rows_per_expert, second)
    # the worker warpgroup's wgmma pipeline only in PTX edited by `warp_specialize.unlooped_workers` (the launcher's)
    gl.warp_specialize([
        (_consumer_partition, (operands, GROUP, PER_CHANNEL, HAS_ZERO, HAS_MIN, SWIGLU, 0)),
        (_consumer_partition, (operands, GROUP, PER_CHANNEL, HAS_ZERO, HAS_MIN, SWIGLU, 1)),
        (_load_partition, (ring,)),
    ], [4, 1], [232, 24])
