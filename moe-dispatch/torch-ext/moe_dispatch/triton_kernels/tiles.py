"""Device helpers of the expert kernels: the dot, dense weight tiles and 4-bit tiles dequantized in registers."""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the Triton interpreter multiplies bf16 operands as their raw bits; give it fp32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


# ----------------------------------------------------------------------------------------------------
# Expert GEMMs
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _expert_weights(w_ptr, shared_ptr, e, num_routed, stride_we, stride_wn, stride_sn, HAS_SHARED: tl.constexpr):
    """Base pointer and row stride of expert e's weight matrix; expert id num_routed is the shared one."""
    base = w_ptr + e.to(tl.int64) * stride_we
    stride_n = stride_wn
    if HAS_SHARED:
        if e == num_routed:
            base = shared_ptr
            stride_n = stride_sn
    return base, stride_n


@triton.jit
def _swiglu_tile(a_ptrs, a_ok, g_ptrs, u_ptrs, n_ok, K, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """SiLU(A @ Wg^T) * (A @ Wu^T) in fp32 for one tile; A rows outside a_ok read as zero."""
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=a_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc_g = _dot(a, g, acc_g, PRECISION, UPCAST)
        acc_u = _dot(a, u, acc_u, PRECISION, UPCAST)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    return acc_g / (1.0 + tl.exp(-acc_g)) * acc_u


@triton.jit
def _matmul_tile(a_ptrs, a_ok, b_ptrs, n_ok, K, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """A @ W^T in fp32 for one tile; A rows outside a_ok read as zero."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=a_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = _dot(a, b, acc, PRECISION, UPCAST)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


# 4-bit experts (quantized.py's layout): one packed K-tile of 128 columns per step, dequantized in registers into
# a [BLOCK_N, 128] operand of the activation dtype, then one K=128 tl.dot; the same loop structure as the dense
# tiles above. The format is a set of constexprs (NF4, HAS_ZERO, HAS_MIN, GROUP), so each format compiles to
# its own straight-line dequantization and the dense kernels are unchanged (QUANT=False).
_MAGIC_BITS = tl.constexpr(0x4B000000)  # 2**23 as fp32 bits: (code | bits) read as fp32 is 2**23 + code
_MAGIC = tl.constexpr(8388608.0)
_TILE = tl.constexpr(128)  # K-columns per packed tile
# int4 without minima whose scale groups span whole tiles (>= 128 columns, or per channel): the dots take the
# exact integers code - zero and each tile's fp32 partial product is scaled once (SCALE_ON_ACC), so the operand
# is not rounded and the scale costs one multiply per output and tile instead of one per weight. False: the
# scale goes on the operand as for the other formats (for tuning).
SCALE_ON_ACC = True
_WORDS = tl.constexpr(16)  # int32 words per packed tile and row


@triton.jit
def _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, J: tl.constexpr, NF4: tl.constexpr,
           HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr):
    """Nibble plane J of a [BLOCK_N, 16] word tile (K-columns 128 tile + 16 J + c) dequantized in fp32:
    ``(code - zero) * scale`` (zero 8 when symmetric), ``code * scale + min`` or ``codebook[code] * scale``.
    SCALE_ON_ACC (int4 without minima, one group per tile): the exact integers ``code - zero``, unscaled."""
    code = (w >> (4 * J)) & 0xF
    if GROUP == -1:  # per channel: one group
        offs = rows
    else:
        # GROUP is a compile-time constant (32, 64 or a multiple of 128): the planes of one group share loads
        if GROUP < 128:
            group = tile * (128 // GROUP) + (J * 16) // GROUP
        else:
            group = tile // (GROUP // 128)
        offs = tl.cast(group, tl.int64) * stride_sg + rows
    if NF4:
        v = tl.load(cb_ptr + code)
    else:
        v = (code | _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC
        if HAS_ZERO:
            v = v - tl.load(z_base + offs, mask=n_ok, other=0).to(tl.float32)[:, None]
        elif not HAS_MIN:
            v = v - 8.0
    if SCALE_ON_ACC:
        return v
    scale = tl.load(s_base + offs, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_MIN:
        return v * scale + tl.load(m_base + offs, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    return v * scale


@triton.jit
def _natural_order(p0, p1, p2, p3, p4, p5, p6, p7):
    """8 planes [R, 16] (plane j: tile columns 16 j + c) as one [R, 128] tile in column order."""
    # [R, 16, 2, 2, 2] with plane index 4 t2 + 2 t1 + t0 -> [R, t2, t1, t0, c] -> column 16 j + c
    planes = tl.join(tl.join(tl.join(p0, p1), tl.join(p2, p3)), tl.join(tl.join(p4, p5), tl.join(p6, p7)))
    return tl.reshape(tl.permute(planes, (0, 4, 3, 2, 1)), (planes.shape[0], 128))


# Packed operands (int4 without minima, one scale group per tile, 16-bit activations: `PACKED`): a nibble shifted
# into the top 4 mantissa bits of 1.0 (fp16 0x3C00: bits 6-9; bf16 0x3F80: bits 3-6) reads as exactly
# 1 + code / 16, and nibbles j and j + 4 of a word sit in the two 16-bit halves, so one shift and one mask-and-OR
# make two operands with no int -> float conversion; subtracting 1 + zero / 16 gives (code - zero) / 16 exactly
# (at most 5 significant bits), and the factor 16 rides on the tile's scale. w4a16's tensor-core path makes its
# operands the same way (fewer instructions per weight than the fp32 planes at every token count it measured).
@triton.jit
def _unit_pair(w, SHIFT: tl.constexpr, BF16: tl.constexpr):
    """Planes j and j + 4 of each word as 1 + code / 16 (SHIFT = 4 j - the mantissa position of the nibble)."""
    if SHIFT >= 0:
        t = w >> SHIFT
    else:
        t = w << -SHIFT
    if BF16:
        t = (t & 0x00780078) | 0x3F803F80
        dtype = tl.bfloat16
    else:
        t = (t & 0x03C003C0) | 0x3C003C00
        dtype = tl.float16
    return t.to(tl.int16).to(dtype, bitcast=True), (t >> 16).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def _packed_planes(w, unit_zero, DTYPE: tl.constexpr):
    """A [BLOCK_N, 16] word tile as one [BLOCK_N, 128] tile of (code - zero) / 16 in K order (DTYPE fp16 / bf16)."""
    bf16: tl.constexpr = DTYPE == tl.bfloat16
    p0, p4 = _unit_pair(w, -3 if bf16 else -6, bf16)
    p1, p5 = _unit_pair(w, 1 if bf16 else -2, bf16)
    p2, p6 = _unit_pair(w, 5 if bf16 else 2, bf16)
    p3, p7 = _unit_pair(w, 9 if bf16 else 6, bf16)
    return _natural_order(p0 - unit_zero, p1 - unit_zero, p2 - unit_zero, p3 - unit_zero,
                          p4 - unit_zero, p5 - unit_zero, p6 - unit_zero, p7 - unit_zero)


@triton.jit
def _dequant_tile(q_base, s_base, z_base, m_base, cb_ptr, rows, n_ok, tile, stride_qn, stride_sg,
                  NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr,
                  SCALE_ON_ACC: tl.constexpr, PACKED: tl.constexpr, UPCAST: tl.constexpr, DTYPE: tl.constexpr):
    """Rows `rows` (int64; rows outside n_ok read as zero words) of one expert's K-tile `tile` as a [BLOCK_N, 128]
    tile of DTYPE in K order: 16 words per row (four 128-bit loads), streamed once (evicted first). PACKED: the
    values are (code - zero) / 16 (`_packed_planes`; `_accumulate` puts the 16 on the scale), made in fp16 under
    UPCAST (the interpreter: its bf16 bitcasts do not read bf16 bits) and converted exactly."""
    col = tl.arange(0, _WORDS)
    w = tl.load(q_base + rows[:, None] * stride_qn + tile * _WORDS + col[None, :], mask=n_ok[:, None], other=0,
                eviction_policy="evict_first")
    if PACKED:
        planes: tl.constexpr = tl.float16 if UPCAST else DTYPE
        if HAS_ZERO:
            zero = tl.load(z_base + _group_offs(rows, tile, stride_sg, GROUP), mask=n_ok, other=0)
            unit_zero = (1.0 + zero.to(tl.float32) * 0.0625).to(planes)[:, None]  # exact: 1 + z / 16
        else:
            unit_zero = tl.full([1, 1], 1.5, planes)  # symmetric: 1 + 8 / 16
        return _packed_planes(w, unit_zero, planes).to(DTYPE)
    return _natural_order(
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 0, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 1, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 2, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 3, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 4, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 5, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 6, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE),
        _plane(w, tile, rows, n_ok, s_base, z_base, m_base, cb_ptr, stride_sg, 7, NF4, HAS_ZERO, HAS_MIN,
               GROUP, SCALE_ON_ACC).to(DTYPE))


@triton.jit
def _group_offs(rows, tile, stride_sg, GROUP: tl.constexpr):
    """Offsets of the group parameters (scales, zero points) of K-tile `tile` (one group spans it)."""
    if GROUP == -1:
        return rows
    return tl.cast(tile // (GROUP // 128), tl.int64) * stride_sg + rows


@triton.jit
def _tile_scales(s_base, rows, n_ok, tile, stride_sg, GROUP: tl.constexpr):
    """[BLOCK_N] fp32 scales of K-tile `tile` (one group spans it)."""
    return tl.load(s_base + _group_offs(rows, tile, stride_sg, GROUP), mask=n_ok, other=0.0).to(tl.float32)


@triton.jit
def _accumulate(a, w, acc, s_base, rows, n_ok, tile, stride_sg, GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr,
                PACKED: tl.constexpr, SWAP_AB: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ w^T for a dequantized [BLOCK_N, 128] tile w ([BLOCK_M, BLOCK_N]); SWAP_AB: acc + w @ a^T
    ([BLOCK_N, BLOCK_M]: the weight rows fill the MMA's M, and the dequantized operand is the one taken from
    registers). SCALE_ON_ACC: w holds unscaled integers (PACKED: divided by 16), and the tile's product is
    scaled here, per weight row, before it is added."""
    # one return: Triton compiles the statements after a constexpr if's return too
    if SWAP_AB:
        lhs, rhs = w, tl.trans(a)
    else:
        lhs, rhs = a, tl.trans(w)
    if SCALE_ON_ACC:
        part = _dot(lhs, rhs, tl.zeros(acc.shape, dtype=tl.float32), PRECISION, UPCAST)
        scale = _tile_scales(s_base, rows, n_ok, tile, stride_sg, GROUP)
        if PACKED:
            scale = scale * 16.0
        if SWAP_AB:
            acc = acc + part * scale[:, None]
        else:
            acc = acc + part * scale[None, :]
    else:
        acc = _dot(lhs, rhs, acc, PRECISION, UPCAST)
    return acc


@triton.jit
def _acc_init(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    if SWAP_AB:  # one return (see `_accumulate`)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def _acc_rows_first(acc, SWAP_AB: tl.constexpr):
    """An accumulator as [BLOCK_M, BLOCK_N] (token rows first)."""
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _swiglu_tile_q(a_ptrs, a_ok, q_base, s_base, z_base, m_base, cb_ptr, g_rows, u_rows, n_ok, K, stride_qn,
                   stride_sg, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, NF4: tl.constexpr, HAS_ZERO: tl.constexpr,
                   HAS_MIN: tl.constexpr, GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr, PACKED: tl.constexpr,
                   SWAP_AB: tl.constexpr, DTYPE: tl.constexpr):
    """`_swiglu_tile` on 4-bit weights: `a_ptrs` [BLOCK_M, 128] at K-column 0, gate / up rows `g_rows` / `u_rows`;
    returns [BLOCK_M, BLOCK_N]."""
    acc_g = _acc_init(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_u = _acc_init(BLOCK_M, BLOCK_N, SWAP_AB)
    offs_k = tl.arange(0, _TILE)
    for tile in range(0, tl.cdiv(K, _TILE)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
        else:  # columns past K: x reads zero (the padded codes there need not dequantize to zero)
            a = tl.load(a_ptrs, mask=a_ok[:, None] & (offs_k + tile * _TILE < K)[None, :], other=0.0)
        # gate, then up: one dequantized tile live at a time
        g = _dequant_tile(q_base, s_base, z_base, m_base, cb_ptr, g_rows, n_ok, tile, stride_qn, stride_sg, NF4,
                          HAS_ZERO, HAS_MIN, GROUP, SCALE_ON_ACC, PACKED, UPCAST, DTYPE)
        acc_g = _accumulate(a, g, acc_g, s_base, g_rows, n_ok, tile, stride_sg, GROUP, SCALE_ON_ACC, PACKED,
                            SWAP_AB, PRECISION, UPCAST)
        u = _dequant_tile(q_base, s_base, z_base, m_base, cb_ptr, u_rows, n_ok, tile, stride_qn, stride_sg, NF4,
                          HAS_ZERO, HAS_MIN, GROUP, SCALE_ON_ACC, PACKED, UPCAST, DTYPE)
        acc_u = _accumulate(a, u, acc_u, s_base, u_rows, n_ok, tile, stride_sg, GROUP, SCALE_ON_ACC, PACKED,
                            SWAP_AB, PRECISION, UPCAST)
        a_ptrs += _TILE
    return _acc_rows_first(acc_g / (1.0 + tl.exp(-acc_g)) * acc_u, SWAP_AB)


@triton.jit
def _matmul_tile_q(a_ptrs, a_ok, q_base, s_base, z_base, m_base, cb_ptr, rows, n_ok, K, stride_qn, stride_sg,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   EVEN_K: tl.constexpr, NF4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
                   GROUP: tl.constexpr, SCALE_ON_ACC: tl.constexpr, PACKED: tl.constexpr, SWAP_AB: tl.constexpr,
                   DTYPE: tl.constexpr):
    """`_matmul_tile` on 4-bit weights; returns [BLOCK_M, BLOCK_N]."""
    acc = _acc_init(BLOCK_M, BLOCK_N, SWAP_AB)
    offs_k = tl.arange(0, _TILE)
    for tile in range(0, tl.cdiv(K, _TILE)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=a_ok[:, None] & (offs_k + tile * _TILE < K)[None, :], other=0.0)
        b = _dequant_tile(q_base, s_base, z_base, m_base, cb_ptr, rows, n_ok, tile, stride_qn, stride_sg, NF4,
                          HAS_ZERO, HAS_MIN, GROUP, SCALE_ON_ACC, PACKED, UPCAST, DTYPE)
        acc = _accumulate(a, b, acc, s_base, rows, n_ok, tile, stride_sg, GROUP, SCALE_ON_ACC, PACKED, SWAP_AB,
                          PRECISION, UPCAST)
        a_ptrs += _TILE
    return _acc_rows_first(acc, SWAP_AB)


@triton.jit
def _quant_bases(w_ptr, s_ptr, z_ptr, m_ptr, e, stride_we, stride_se):
    """Expert e's packed words and group parameters (zeros and minima share the scales' layout)."""
    e64 = e.to(tl.int64)
    return w_ptr + e64 * stride_we, s_ptr + e64 * stride_se, z_ptr + e64 * stride_se, m_ptr + e64 * stride_se


# Programmatic dependent launch (sm_90+): a kernel launched with `launch_pdl` may start while the kernel before
# it finishes, and waits in `_pdl_wait` (griddepcontrol.wait: the prerequisite grid complete, its writes visible)
# before reading what that kernel wrote; `_pdl_launch_dependents` lets the next one start early. At a few tokens
# the layer's launches are short, so launch latency and each kernel's ramp are a large part of their time.
@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _pdl_launch_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
