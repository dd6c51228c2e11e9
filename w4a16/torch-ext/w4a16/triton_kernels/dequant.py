"""The dequantize kernel: 4-bit weights to fp16 / bf16 / fp32 (dequantize, then cuBLAS, at large M)."""

import triton
import triton.language as tl

from .common import _WORDS, _tile_in_k_order


@triton.jit
def _dequant_kernel(
    qw_ptr, s_ptr, z_ptr, m_ptr, cb_ptr, out_ptr,
    N, K, num_tiles, group_size: tl.constexpr, stride_qn, stride_sg, stride_on,
    NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr,
):
    """Write the dequantized weight ``[N, K]`` (stored K order) in the output's dtype, each 128-column tile
    put back in K order in registers (`_natural_order`) and stored whole: on the H200 1-6 % faster dequantize +
    cuBLAS at M = 1024 than storing the 8 nibble planes as runs of 16 columns (docs/design/w4a16.md, E2b). The
    group size is a compile-time constant, so the 8 planes of a tile share one scale (and zero) load instead of
    one each (E10)."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    col = tl.arange(0, _WORDS)
    row_ok = (rows < N)[:, None]
    zero = 0.0
    if PER_CHANNEL:  # `_plane` leaves per-channel scales to the caller
        scale = tl.load(s_ptr + rows).to(tl.float32)[:, None]
        if HAS_ZERO:
            zero = tl.load(z_ptr + rows).to(tl.float32)[:, None]
    for i in tl.static_range(TILES):
        tile = pid_t * TILES + i
        if tile < num_tiles:
            w = tl.load(qw_ptr + rows64[:, None] * stride_qn + tile * _WORDS + col[None, :], eviction_policy="evict_first")
            if PER_CHANNEL:
                v = _tile_in_k_order(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, NF4,
                                     HAS_ZERO, False, True, False, tl.float32) * scale
                v = v.to(out_ptr.dtype.element_ty)
            else:
                v = _tile_in_k_order(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, NF4,
                                     HAS_ZERO, HAS_MIN, False, False, out_ptr.dtype.element_ty)
            k = tile * 128 + tl.arange(0, 128)
            tl.store(out_ptr + rows64[:, None] * stride_on + k[None, :], v, mask=row_ok & (k < K)[None, :])
