"""What the kernel families share: the 2**23 magic for int -> float, word tiles, the SwiGLU epilogue, the split-K
reduction."""

import triton
import triton.language as tl

from ..formats import GATE_UP_BLOCK, WORDS_PER_TILE

_MAGIC_BITS = tl.constexpr(0x4B000000)
_MAGIC = tl.constexpr(8388608.0)  # 2**23
_WORDS = tl.constexpr(WORDS_PER_TILE)
_PAIR = tl.constexpr(GATE_UP_BLOCK)


@triton.jit
def _word_tiles(w_ptrs, tile, live, MASKED: tl.constexpr):
    """The [BLOCK_N, TILES, 16] words of K-tiles `tile` (dead tiles read as 0 when MASKED); weights are
    streamed once, so they are evicted first."""
    offs = w_ptrs + tile[None, :, None] * _WORDS
    if MASKED:
        w = tl.load(offs, mask=live[None, :, None], other=0, eviction_policy="evict_first")
    else:
        w = tl.load(offs, eviction_policy="evict_first")
    return w


@triton.jit
def _natural_order(p0, p1, p2, p3, p4, p5, p6, p7):
    """8 planes [R, 16] (plane j: tile columns 16 j + c) as one [R, 128] tile in column order."""
    # [R, 16, 2, 2, 2] with plane index 4 t2 + 2 t1 + t0 -> [R, t2, t1, t0, c] -> column 16 j + c
    planes = tl.join(tl.join(tl.join(p0, p1), tl.join(p2, p3)), tl.join(tl.join(p4, p5), tl.join(p6, p7)))
    return tl.reshape(tl.permute(planes, (0, 4, 3, 2, 1)), (planes.shape[0], 128))


@triton.jit
def _half_bits(h):
    """16-bit floats as the int32 holding their bits in the low half."""
    return h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _plane_group(tile, J: tl.constexpr, group_size: tl.constexpr):
    """The scale group of K-tile `tile`'s nibble plane J (columns 128 tile + 16 J + c); group_size is a
    compile-time constant (32, 64 or a multiple of 128), so the planes of one group share one parameter load."""
    if group_size < 128:
        return tile * (128 // group_size) + (J * 16) // group_size
    else:
        return tile // (group_size // 128)


@triton.jit
def _plane(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size: tl.constexpr, stride_sg, J: tl.constexpr,
           NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, PER_CHANNEL: tl.constexpr,
           SCALE_ON_ACC: tl.constexpr):
    """Nibble plane J of a [BLOCK_N, 16] word tile (K-columns 128 tile + 16 J + c) as fp32: ``code - zero``
    (times its group's scale unless the scale is applied to the accumulator), ``code * scale + min`` (HAS_MIN:
    scale groups, never on the accumulator), or the NF4 value."""
    code = (w >> (4 * J)) & 0xF
    if not PER_CHANNEL:
        param_offs = tl.cast(_plane_group(tile, J, group_size), tl.int64) * stride_sg + rows
    if NF4:
        v = tl.load(cb_ptr + code)
    else:
        v = (code | _MAGIC_BITS).to(tl.float32, bitcast=True)
        if HAS_ZERO:
            if not PER_CHANNEL:
                zero = tl.load(z_ptr + param_offs).to(tl.float32)[:, None]
            v = v - (zero + _MAGIC)
        elif HAS_MIN:
            v = v - _MAGIC
        else:
            v = v - (_MAGIC + 8.0)
    if HAS_MIN:
        low = tl.load(m_ptr + param_offs).to(tl.float32)[:, None]
        v = v * tl.load(s_ptr + param_offs).to(tl.float32)[:, None] + low
    elif not SCALE_ON_ACC and not PER_CHANNEL:
        v = v * tl.load(s_ptr + param_offs).to(tl.float32)[:, None]
    return v


@triton.jit
def _tile_in_k_order(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size: tl.constexpr, stride_sg,
                     NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, PER_CHANNEL: tl.constexpr,
                     SCALE_ON_ACC: tl.constexpr, DTYPE: tl.constexpr):
    """A [BLOCK_N, 16] word tile dequantized by `_plane` into one [BLOCK_N, 128] tile of DTYPE in K order."""
    return _natural_order(
        _plane(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, 0, NF4, HAS_ZERO, HAS_MIN,
               PER_CHANNEL, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, 1, NF4, HAS_ZERO, HAS_MIN,
               PER_CHANNEL, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, 2, NF4, HAS_ZERO, HAS_MIN,
               PER_CHANNEL, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, 3, NF4, HAS_ZERO, HAS_MIN,
               PER_CHANNEL, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, 4, NF4, HAS_ZERO, HAS_MIN,
               PER_CHANNEL, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, 5, NF4, HAS_ZERO, HAS_MIN,
               PER_CHANNEL, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, 6, NF4, HAS_ZERO, HAS_MIN,
               PER_CHANNEL, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, s_ptr, z_ptr, m_ptr, cb_ptr, zero, group_size, stride_sg, 7, NF4, HAS_ZERO, HAS_MIN,
               PER_CHANNEL, SCALE_ON_ACC).to(DTYPE))


def _i32(bits: int) -> int:
    """A 32-bit pattern as the signed int32 Triton takes as a constant."""
    return bits - (1 << 32) if bits >= 1 << 31 else bits


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up in fp32."""
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _swiglu_rows(acc, ROWS_FIRST: tl.constexpr):
    """silu(gate) * up of a 2-D fp32 tile of fused rows (axis 0 when ROWS_FIRST, else axis 1) in the SwiGLU layout
    (`formats.GATE_UP_BLOCK`): rows 16 b + i (gate) and 16 b + 8 + i (up) give result row 8 b + i, so the tile's
    2 R rows become R. In the MMA accumulator layouts one thread holds rows r and r + 8, so reshape, permute and
    split can stay in registers (not yet checked in compiled code)."""
    if ROWS_FIRST:
        blocks = tl.reshape(acc, (acc.shape[0] // (2 * _PAIR), 2, _PAIR, acc.shape[1]))
        gate, up = tl.split(tl.permute(blocks, (0, 2, 3, 1)))
        out = tl.reshape(_silu_mul(gate, up), (acc.shape[0] // 2, acc.shape[1]))
    else:
        blocks = tl.reshape(acc, (acc.shape[0], acc.shape[1] // (2 * _PAIR), 2, _PAIR))
        gate, up = tl.split(tl.permute(blocks, (0, 1, 3, 2)))
        out = tl.reshape(_silu_mul(gate, up), (acc.shape[0], acc.shape[1] // 2))
    return out


@triton.jit
def _split_sum(part_ptr, offs, mask, stride_split, SPLIT: tl.constexpr):
    """The SPLIT partials at `offs` summed in split order (deterministic), in fp32."""
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * stride_split + offs, mask=mask, other=0.0)
    return acc


@triton.jit
def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, total, N, out_stride, split_stride,
                          SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr, LATE_TRIGGER: tl.constexpr, STRIDED: tl.constexpr):
    """out = sum of the SPLIT fp32 partials ``[SPLIT, M, N]`` (`split_stride` elements apart) in a fixed order
    (deterministic) + bias, cast once.
    SWIGLU: `out` is ``[M, N // 2]``, silu(gate) * up of the summed fused rows (bias added first); it also runs
    with SPLIT = 1 on the 16-bit product of dequantize + cuBLAS (its SwiGLU epilogue). PDL: launched as a
    programmatic dependent of the split kernel, the next kernel let launch at once, or after the stores with
    LATE_TRIGGER. STRIDED: `out` is a column slice ``[M, N]`` of rows `out_stride` apart (not with SWIGLU)."""
    _pdl_wait(PDL)
    _pdl_launch_dependents(PDL and not LATE_TRIGGER)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    if SWIGLU:
        half = N // 2
        col = offs % half
        gate_offs = (offs // half) * N + (col // _PAIR) * (2 * _PAIR) + col % _PAIR
        gate = _split_sum(part_ptr, gate_offs, mask, split_stride, SPLIT)
        up = _split_sum(part_ptr, gate_offs + _PAIR, mask, split_stride, SPLIT)
        if HAS_BIAS:
            gate += tl.load(bias_ptr + gate_offs % N, mask=mask, other=0.0).to(tl.float32)
            up += tl.load(bias_ptr + gate_offs % N + _PAIR, mask=mask, other=0.0).to(tl.float32)
        acc = _silu_mul(gate, up)
    else:
        acc = _split_sum(part_ptr, offs, mask, split_stride, SPLIT)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    if STRIDED:
        offs = (offs // N) * out_stride + offs % N
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    _pdl_launch_dependents(PDL and LATE_TRIGGER)


# Programmatic dependent launch (sm_90+, `launch.dependent_launch`): a kernel launched with `launch_pdl` may be
# scheduled while the kernel before it drains; it waits in griddepcontrol.wait (the prior grid complete and its
# writes visible) before it reads or writes anything, since its output may reuse memory the prior kernel still
# reads. It lets the next kernel launch once its K loop is done: triggered at its start instead, the next kernel's
# programs sat waiting beside these for their whole run wherever one wave left SM slots free, and slowed them up
# to 1.8x (docs/design/w4a16.md E18, run 54).
@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _pdl_launch_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
