"""The dequantize kernel: 4-bit weights to fp16 / bf16 / fp32 (dequantize, then cuBLAS, at large M)."""

import triton
import triton.language as tl

from .common import _MAGIC, _MAGIC_BITS, _WORDS, _natural_order


@triton.jit
def _dequant_kernel(
    qw_ptr, s_ptr, z_ptr, cb_ptr, out_ptr,
    N, K, num_tiles, group_size, stride_qn, stride_sg, stride_on,
    NF4: tl.constexpr, HAS_ZERO: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr,
):
    """Write the dequantized weight ``[N, K]`` (stored K order) in the output's dtype."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    tile = pid_t * TILES + tl.arange(0, TILES)
    col = tl.arange(0, _WORDS)
    live = tile < num_tiles
    w = tl.load(qw_ptr + rows64[:, None, None] * stride_qn + tile[None, :, None] * _WORDS + col[None, None, :],
                mask=live[None, :, None], other=0, eviction_policy="evict_first")
    row_ok = (rows < N)[:, None, None]
    for j in tl.static_range(8):
        k = tile[:, None] * 128 + j * 16 + col[None, :]
        if PER_CHANNEL:
            group = tile * 0
        else:
            group = (tile * 128 + j * 16) // group_size
        param_offs = group[None, :].to(tl.int64) * stride_sg + rows[:, None]
        s = tl.load(s_ptr + param_offs, mask=live[None, :], other=0.0).to(tl.float32)[:, :, None]
        code = (w >> (4 * j)) & 0xF
        if NF4:
            v = tl.load(cb_ptr + code)
        else:
            v = (code | _MAGIC_BITS).to(tl.float32, bitcast=True)
            if HAS_ZERO:
                zero = tl.load(z_ptr + param_offs, mask=live[None, :], other=0).to(tl.float32)[:, :, None]
                v = v - (zero + _MAGIC)
            else:
                v = v - (_MAGIC + 8.0)
        tl.store(out_ptr + rows64[:, None, None] * stride_on + k[None, :, :], (v * s).to(out_ptr.dtype.element_ty),
                 mask=row_ok & (k < K)[None, :, :])


@triton.jit
def _dequant_natural_kernel(
    qw_ptr, s_ptr, z_ptr, cb_ptr, out_ptr,
    N, K, num_tiles, group_size, stride_qn, stride_sg, stride_on,
    NF4: tl.constexpr, HAS_ZERO: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr,
):
    """`_dequant_kernel` with each 128-column tile put back in K order in registers (`_natural_order`), so
    every row's tile is stored as contiguous 16-byte vectors instead of 8 runs of 16 columns."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    col = tl.arange(0, _WORDS)
    row_ok = (rows < N)[:, None]
    for i in tl.static_range(TILES):
        tile = pid_t * TILES + i
        if tile < num_tiles:
            w = tl.load(qw_ptr + rows64[:, None] * stride_qn + tile * _WORDS + col[None, :], eviction_policy="evict_first")
            p0 = _dequant_plane(w, tile, rows, s_ptr, z_ptr, cb_ptr, group_size, stride_sg, 0, NF4, HAS_ZERO, PER_CHANNEL)
            p1 = _dequant_plane(w, tile, rows, s_ptr, z_ptr, cb_ptr, group_size, stride_sg, 1, NF4, HAS_ZERO, PER_CHANNEL)
            p2 = _dequant_plane(w, tile, rows, s_ptr, z_ptr, cb_ptr, group_size, stride_sg, 2, NF4, HAS_ZERO, PER_CHANNEL)
            p3 = _dequant_plane(w, tile, rows, s_ptr, z_ptr, cb_ptr, group_size, stride_sg, 3, NF4, HAS_ZERO, PER_CHANNEL)
            p4 = _dequant_plane(w, tile, rows, s_ptr, z_ptr, cb_ptr, group_size, stride_sg, 4, NF4, HAS_ZERO, PER_CHANNEL)
            p5 = _dequant_plane(w, tile, rows, s_ptr, z_ptr, cb_ptr, group_size, stride_sg, 5, NF4, HAS_ZERO, PER_CHANNEL)
            p6 = _dequant_plane(w, tile, rows, s_ptr, z_ptr, cb_ptr, group_size, stride_sg, 6, NF4, HAS_ZERO, PER_CHANNEL)
            p7 = _dequant_plane(w, tile, rows, s_ptr, z_ptr, cb_ptr, group_size, stride_sg, 7, NF4, HAS_ZERO, PER_CHANNEL)
            dt = out_ptr.dtype.element_ty
            v = _natural_order(p0.to(dt), p1.to(dt), p2.to(dt), p3.to(dt), p4.to(dt), p5.to(dt), p6.to(dt), p7.to(dt))
            k = tile * 128 + tl.arange(0, 128)
            tl.store(out_ptr + rows64[:, None] * stride_on + k[None, :], v, mask=row_ok & (k < K)[None, :])


@triton.jit
def _dequant_plane(w, tile, rows, s_ptr, z_ptr, cb_ptr, group_size, stride_sg, J: tl.constexpr,
                   NF4: tl.constexpr, HAS_ZERO: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """Nibble plane J of a [BLOCK_N, 16] word tile (K-columns 128 tile + 16 J + c), dequantized in fp32."""
    if PER_CHANNEL:
        param_offs = rows
    else:
        param_offs = ((tile * 128 + J * 16) // group_size).to(tl.int64) * stride_sg + rows
    code = (w >> (4 * J)) & 0xF
    if NF4:
        v = tl.load(cb_ptr + code)
    else:
        v = (code | _MAGIC_BITS).to(tl.float32, bitcast=True)
        if HAS_ZERO:
            v = v - (tl.load(z_ptr + param_offs).to(tl.float32)[:, None] + _MAGIC)
        else:
            v = v - (_MAGIC + 8.0)
    return v * tl.load(s_ptr + param_offs).to(tl.float32)[:, None]
