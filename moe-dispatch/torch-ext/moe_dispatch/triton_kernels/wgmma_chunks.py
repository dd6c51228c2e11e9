"""The int4 operand of a wgmma kernel's 64-row chain, made in registers one 16-column K-chunk at a time: a group's
stored parameters and their conversion, the PTX that dequantizes two K columns a register, the chunk's step
(operand made, MMA issued) and accumulator zeros ptxas cannot see through.

w4a16 and moe-dispatch each carry this file (standalone Hub packages import nothing of each other) for their wgmma
kernels (`wgmma`); the copies are the same bytes, which tests/test_moe_dispatch_quantized.py checks. The design
behind each piece is on w4a16's design page (docs/design/w4a16.md: E12-E13 chains, E37 in-flight chunks, E40
opaque zeros)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma


@gluon.constexpr_function
def _pair_asm(j, is_fp16):
    """PTX for nibble position `j` of two neighbouring words a, b (columns 16 j + c and 16 j + c + 1): their
    bytes j // 2 side by side (PRMT), the nibble under an exponent ((p & 0x000f000f) | magic: 1024 + q in fp16,
    128 + q in bf16), then ``(v - shift) * scale + addend`` on the pair: two operand values in one register."""
    byte = j // 2
    select = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12)
    kind = "f16x2" if is_fp16 else "bf16x2"
    magic = 0x64006400 if is_fp16 else 0x43004300
    shift = "shr.u32 p, p, 4;" if j % 2 else ""
    return (f"{{ .reg .b32 p; prmt.b32 p, $1, $2, {select:#x}; {shift} "
            f"lop3.b32 p, p, 0x000f000f, {magic:#x}, 0xea; sub.{kind} p, p, $3; fma.rn.{kind} $0, p, $4, $5; }}")


@gluon.jit
def _group_stored(s_ptr, z_ptr, m_ptr, g, s_stride, rows, HAS_ZERO: gl.constexpr, HAS_MIN: gl.constexpr):
    """One group's stored scales, zero points and minima for `rows` as loaded from global memory (the scales stand
    in for what the format lacks), for `_group_params` to convert."""
    scale = gl.load(s_ptr + g * s_stride + rows)
    if HAS_ZERO:
        zero = gl.load(z_ptr + g * s_stride + rows)
    else:
        zero = scale
    if HAS_MIN:
        minimum = gl.load(m_ptr + g * s_stride + rows)
    else:
        minimum = scale
    return scale, zero, minimum


@gluon.jit
def _group_params(stored, HAS_ZERO: gl.constexpr, HAS_MIN: gl.constexpr, NF4: gl.constexpr, dtype: gl.constexpr):
    """NF4: the scales as w4a16's `wgmma._nf4_chunks_asm` multiplies them (fp16 where x and the scales are, else
    fp32). int4: (scale, shift, addend), where ``(v - shift) * scale + addend`` is the weight of v = magic + code
    (`_pair_asm`)."""
    scale, zero, minimum = stored
    if NF4:
        if not (dtype == gl.float16 and scale.dtype == gl.float16):
            scale = scale.to(gl.float32)
        return scale
    else:
        magic_value: gl.constexpr = 1024.0 if dtype == gl.float16 else 128.0
        scale = scale.to(dtype)
        if HAS_ZERO:
            shift = zero.to(dtype) + magic_value
        else:
            shift = gl.zeros_like(scale) + (magic_value + (0.0 if HAS_MIN else 8.0))
        if HAS_MIN:
            addend = minimum.to(dtype)
        else:
            addend = gl.zeros_like(scale)
        return scale, shift, addend


@gluon.jit
def _opaque_zeros(shape: gl.constexpr, layout: gl.constexpr):
    """fp32 zeros ptxas sees as the result of an opaque move (inline asm, not pure), not as a constant: a constant
    accumulator must be copied into the K loop's result registers on its zero-trip path, and in a worker partition
    Triton lays those copies out between the last wgmma and its wait, which serializes every wgmma (C7515)."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [gl.zeros(shape, gl.int32, layout=layout)],
                                     gl.float32, is_pure=False, pack=1)


@gluon.jit
def _chain_step(words, j: gl.constexpr, params, acc, x_chunk):
    """K-chunk j of one 64-row chain: nibble j of the words held in the operand's layout, dequantized in place
    (neighbouring words are neighbouring K columns: two elements per PTX call, one register of two values), and
    its MMA issued (asynchronous)."""
    scale, shift, addend = params
    a = gl.inline_asm_elementwise(_pair_asm(j, scale.dtype == gl.float16), "=r,r,r,r,r,r",
                                  [words, shift[:, None], scale[:, None], addend[:, None]],
                                  scale.dtype, is_pure=True, pack=2)
    return a, warpgroup_mma(a, x_chunk, acc, is_async=True)
