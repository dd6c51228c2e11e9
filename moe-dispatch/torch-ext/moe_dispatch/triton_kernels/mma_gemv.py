"""The tensor-core GEMV's K loop (`_mma_acc`): weight rows against a few tokens by `mma.sync` (sm_80+) on
operands built in registers, shared byte for byte by w4a16 (`mma._mma_gemv_kernel`) and moe-dispatch (the
4-bit experts' gate/up GEMV, whose program takes an expert's gate and up rows as its two halves: `SPLIT_ROWS`).

Each warp owns 16-row blocks of the weight and loads their packed words straight into the MMA's A-operand layout:
a thread of an m16n8k16 A fragment holds columns (2c, 2c + 1) and (2c + 8, 2c + 9) of rows g and g + 8, and word c
of a row holds column 16 j + c at nibble j (the packed format), so the 8 words a thread loads are every fragment of
the K-tile's 8 chunks. One PTX block per two neighbouring words (`_pair_planes_asm`) makes all 8 fragments'
registers: 2 PRMT + 2 SHF + 8 LOP3 + 8 HFMA2 for 16 weights, (code - zero) / 16 exactly in fp16 or bf16. The MMA
sums them in fp32; each scale group's sum is scaled once per row. int4 with integer zero points or symmetric, in
scale groups of 32, 64, multiples of 128 or per channel; NF4 through the caller's lookup (`NF4_TILE`)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2


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


@gluon.constexpr_function
def mma_layout(warps, operand):
    """The layout of the GEMV's accumulator ``[rows, tokens]`` (operand -1: 16 x 8 MMA tiles, warps along the rows)
    or of its A (0: weights) or B (1: x) operand."""
    acc = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
    return acc if operand == -1 else gl.DotOperandLayout(operand_index=operand, parent=acc, k_width=2)


@gluon.jit
def block_rows(off_n, row_gap, BLOCK_N: gl.constexpr, SPLIT_ROWS: gl.constexpr, layout: gl.constexpr):
    """The weight rows of a program's BLOCK_N positions: from `off_n` on, or with SPLIT_ROWS its two halves each
    from `off_n` and `off_n + row_gap` (a warp's 16-row blocks of both halves lie in the same threads)."""
    r = gl.arange(0, BLOCK_N, layout=layout)
    if SPLIT_ROWS:
        return off_n + r % (BLOCK_N // 2) + (r // (BLOCK_N // 2)) * row_gap
    return off_n + r


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
              HAS_ZERO: gl.constexpr, SCALE_RING: gl.constexpr, NF4: gl.constexpr, NF4_TILE: gl.constexpr,
              NF4_SHFL: gl.constexpr, NF4_SMEM: gl.constexpr):
    """One K-tile (tile `i` of its iteration) into `acc`: the 8 A operands from its words, and per chunk j one MMA
    with x's fragment j (`xs`, zero where not live); each scale group's sum scaled once. `zlo` / `zhi`: the zero
    constants when they are the same for every tile (per channel, symmetric). With SCALE_RING the iteration's
    scales and zero points come from the shared-memory rings (`s_ring` / `z_ring`: a row of BLOCK_N per group,
    the iteration's first at `g_row`), else from global memory. NF4: the operands are the caller's lookup,
    ``NF4_TILE(words, nf4_tables, nf4_lane, x_like, NF4_SHFL, NF4_SMEM)``."""
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
        a = NF4_TILE(words, nf4_tables, nf4_lane, xs[0], NF4_SHFL, NF4_SMEM)
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
def _mma_acc(x_ptr, qw_ptr, s_ptr, z_ptr, off_m, M, K, off_n, row_gap, tile0, tiles, stride_xm, stride_qn, s_stride,
             nf4_tables, nf4_lane, GROUP: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZERO: gl.constexpr,
             NF4: gl.constexpr, NF4_TILE: gl.constexpr, NF4_SHFL: gl.constexpr, NF4_SMEM: gl.constexpr,
             BLOCK_M: gl.constexpr, REPS: gl.constexpr, TILES: gl.constexpr, MASK_K: gl.constexpr,
             X_SMEM: gl.constexpr, STAGES: gl.constexpr, SPLIT_ROWS: gl.constexpr):
    """The fp32 ``[BLOCK_N, BLOCK_M]`` products (`mma_layout` -1) of the weight rows of a program (16 x warps x REPS
    from `off_n`, `block_rows`) with x's rows from `off_m`, over K-tiles [tile0, tile0 + tiles), TILES of them per
    iteration (their loads issued together: long runs of each row per request burst, as the GEMV's many tiles per
    iteration); per channel times each row's scale. X_SMEM: each iteration's x ``[BLOCK_M, 128 x TILES]`` by
    16-byte loads into shared memory (two buffers, one barrier per iteration) and its B fragments by `ldmatrix`,
    instead of two 4-byte global loads per fragment and thread (their count was the kernel's cost,
    docs/design/w4a16.md E14). STAGES > 1 (x rows 16-byte aligned): a ring of STAGES slots filled by `cp.async`
    STAGES - 1 iterations ahead, holding the words, x and (groups of up to 128) the scales and zero points, so no
    load of an iteration waits in it (E15); the words then reach the A layout from shared memory. NF4: codes looked
    up by `NF4_TILE` in `nf4_tables` (no zero points)."""
    WARPS: gl.constexpr = gl.num_warps()
    BLOCK_N: gl.constexpr = 16 * WARPS * REPS
    RING: gl.constexpr = STAGES > 1
    SCALE_RING: gl.constexpr = RING and not PER_CHANNEL and GROUP <= 128
    acc_layout: gl.constexpr = mma_layout(WARPS, -1)
    a_layout: gl.constexpr = mma_layout(WARPS, 0)
    b_layout: gl.constexpr = mma_layout(WARPS, 1)

    rows = block_rows(off_n, row_gap, BLOCK_N, SPLIT_ROWS, gl.SliceLayout(1, a_layout))
    words_cols = gl.arange(0, 16, layout=gl.SliceLayout(0, a_layout))
    w_ptrs = qw_ptr + rows.to(gl.int64)[:, None] * stride_qn + words_cols[None, :]
    x_k = gl.arange(0, 16, layout=gl.SliceLayout(1, b_layout))
    x_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, b_layout))
    x_ptrs = x_ptr + x_m.to(gl.int64)[None, :] * stride_xm + x_k[:, None]
    m_ok = (x_m < M)[None, :]
    s_rows = block_rows(off_n, row_gap, BLOCK_N, SPLIT_ROWS, gl.SliceLayout(1, acc_layout))

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
    zlo, zhi = _zero_consts(z_ptr, 0, s_stride, rows, True, HAS_ZERO and PER_CHANNEL, x_ptr.dtype.element_ty)
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
        wr_rows = block_rows(off_n, row_gap, BLOCK_N, SPLIT_ROWS, gl.SliceLayout(1, wr_layout))
        wr_cols = gl.arange(0, 16 * TILES, layout=gl.SliceLayout(0, wr_layout))
        wr_ptrs = qw_ptr + wr_rows.to(gl.int64)[:, None] * stride_qn + wr_cols[None, :]
        w_ring = gl.allocate_shared_memory(qw_ptr.dtype.element_ty, [STAGES, BLOCK_N, 16 * TILES],
                                           gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0]))
        x_ring = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_M, 128 * TILES], x_shared)
        # scales and zero points: a row of BLOCK_N per group, GROUPS rows per slot
        GROUPS: gl.constexpr = TILES * 128 // GROUP if SCALE_RING else 1
        sr_n = block_rows(off_n, row_gap, BLOCK_N, SPLIT_ROWS, gl.BlockedLayout([8], [32], [WARPS], [0]))
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
                                SCALE_RING, NF4, NF4_TILE, NF4_SHFL, NF4_SMEM)
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
                                live, rows, s_rows, s_stride, GROUP, PER_CHANNEL, HAS_ZERO, False, NF4, NF4_TILE,
                                NF4_SHFL, NF4_SMEM)
    acc = acc * 16.0
    if PER_CHANNEL:
        acc = acc * gl.load(s_ptr + s_rows).to(gl.float32)[:, None]
    return acc
