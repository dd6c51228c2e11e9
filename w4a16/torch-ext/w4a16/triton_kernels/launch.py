"""Launchers: a config (from `tuning.select`) and the weight tensors -> grid, flags and kernel launch."""

from __future__ import annotations

import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..formats import WORDS_PER_TILE
from .common import _splitk_reduce_kernel
from .dequant import _dequant_kernel
from .dot import _dot_kernel
from .gemv import _gemv_h2_kernel, _gemv_kernel, _x_to_fp16_kernel


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def half2_supported(x, codebook, group_size) -> bool:
    """Whether the packed-fp16 GEMV (`_gemv_h2_kernel`) applies: fp16 activations (bf16 after
    `_x_to_fp16_kernel`), int4 or NF4 with scale groups of whole 128-column tiles or per channel (NF4: also
    64), and an NVIDIA GPU (inline PTX) or the interpreter (emulated). Elsewhere (groups of 32, int4 groups of
    64, ROCm, XPU) the GEMV config runs the portable `_gemv_kernel`."""
    groups_ok = packed_dot_supported(None, group_size) or (codebook is not None and group_size == 64)
    if x.dtype not in (torch.float16, torch.bfloat16) or not groups_ok:
        return False
    return _interpreting() or (x.device.type == "cuda" and torch.version.hip is None)


def packed_dot_supported(codebook, group_size) -> bool:
    """Whether the dot path can take `_unit_planes` operands: int4 with whole-tile or per-channel groups."""
    return codebook is None and (group_size == -1 or group_size % 128 == 0)


def _format_flags(zeros, codebook, group_size) -> dict:
    per_channel = group_size == -1
    return {
        "NF4": codebook is not None,
        "HAS_ZERO": zeros is not None,
        "PER_CHANNEL": per_channel,
        "SUBG": 128 if per_channel else min(group_size, 128),
    }


def _or(t, placeholder):
    """An absent optional tensor is passed as another tensor: its constexpr flag is off, so never read."""
    return t if t is not None else placeholder


def _reduce_splits(part, bias, out, n) -> None:
    total = out.numel()
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(total, block),)](
        part, _or(bias, part), out, total, n,
        SPLIT=part.shape[0], HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
    )


def _launch_gemv(x, qweight, scales, zeros, codebook, bias, out, n, k, group_size, cfg) -> None:
    half2 = cfg.get("half2", False)
    use_half2 = bool(half2) and half2_supported(x, codebook, group_size)
    if use_half2 and isinstance(half2, dict):  # the packed-fp16 GEMV's own tiles (tuned apart from the fp32 one)
        cfg = {**cfg, **half2}
    m = x.shape[0]
    num_tiles = qweight.shape[1] // WORDS_PER_TILE
    block_n, tiles = cfg["block_n"], cfg["tiles"]
    per_split = triton.cdiv(triton.cdiv(num_tiles, cfg.get("split_k", 1)), tiles) * tiles
    splits = triton.cdiv(num_tiles, per_split)
    mask_tiles = num_tiles % per_split != 0
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (qweight.shape[0] // block_n, splits, m)
    common = dict(
        HAS_BIAS=bias is not None, PARTIAL=splits > 1, MASK_X=mask_tiles or k % 128 != 0, MASK_TILES=mask_tiles,
        BLOCK_N=block_n, TILES=tiles, STAGES=cfg.get("num_stages", 1), PREFETCH=bool(cfg.get("prefetch", False)),
        num_warps=cfg.get("num_warps", 4),
    )
    group = qweight.shape[1] * 8 if group_size == -1 else group_size
    if use_half2:
        x_scaled = x.dtype == torch.bfloat16
        x_scales = scales  # unread unless X_SCALED
        if x_scaled:
            x16 = torch.empty(m, k, dtype=torch.float16, device=x.device)
            x_scales = torch.empty(m, num_tiles, dtype=torch.float32, device=x.device)
            _x_to_fp16_kernel[(m, triton.cdiv(num_tiles, 8))](x, x16, x_scales, k, num_tiles, x.stride(0),
                                                               x16.stride(0), TILES=8, num_warps=4)
            x = x16
        w_desc = bool(cfg.get("tma", False))
        qw = qweight
        if w_desc:  # TMA boxes of [block_n, tiles, 16] words (a host descriptor: encoded per launch, no scratch)
            qw = TensorDescriptor(qweight, [qweight.shape[0], num_tiles, WORDS_PER_TILE],
                                  [qweight.stride(0), WORDS_PER_TILE, 1], [block_n, tiles, WORDS_PER_TILE])
        _gemv_h2_kernel[grid](
            x, x_scales, qw, scales, _or(zeros, scales), _or(codebook, scales), _or(bias, scales), target,
            n, k, num_tiles, per_split, group,
            x.stride(0), qweight.stride(0), scales.stride(0), n, m * n,
            HAS_ZERO=zeros is not None, PER_CHANNEL=group_size == -1, X_SCALED=x_scaled,
            NF4=codebook is not None, HALF_GROUPS=group_size == 64,
            X_BCAST=bool(cfg.get("x_bcast", False)), W_DESC=w_desc, EMULATE=_interpreting(),
            # masked tiles mask x per tile (MASK_TILES); descriptor boxes are loaded in the loop, not ahead
            **dict(common, MASK_X=k % 128 != 0, PREFETCH=common["PREFETCH"] and not w_desc),
        )
    else:
        _gemv_kernel[grid](
            x, qweight, scales, _or(zeros, scales),
            _or(codebook, scales), _or(bias, scales), target,
            n, k, num_tiles, per_split, group,
            x.stride(0), qweight.stride(0), scales.stride(0), n, m * n,
            **_format_flags(zeros, codebook, group_size), **common,
        )
    if splits > 1:
        _reduce_splits(target, bias, out, n)


def _launch_dot(x, qweight, scales, zeros, codebook, bias, out, n, k, group_size, cfg) -> None:
    m = x.shape[0]
    num_tiles = qweight.shape[1] // WORDS_PER_TILE
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    per_split = triton.cdiv(num_tiles, cfg.get("split_k", 1))
    splits = triton.cdiv(num_tiles, per_split)
    flags = _format_flags(zeros, codebook, group_size)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m) * (qweight.shape[0] // block_n), splits)
    packed = bool(cfg.get("packed", False)) and packed_dot_supported(codebook, group_size)
    # Scaled operands keep one accumulator chain (the MMA overlaps the next tile's dequantization); per-channel
    # scales always go on the result.
    scale_weights = packed and bool(cfg.get("scale_weights", False)) and group_size != -1
    _dot_kernel[grid](
        x, qweight, scales, _or(zeros, scales),
        _or(codebook, scales), _or(bias, scales), target,
        m, n, k, num_tiles, per_split, qweight.shape[1] * 8 if group_size == -1 else group_size,
        x.stride(0), qweight.stride(0), scales.stride(0), n, m * n,
        **flags, HAS_BIAS=bias is not None, PARTIAL=splits > 1, MASK_K=k % 128 != 0,
        SCALE_ON_ACC=flags["SUBG"] == 128 and not flags["PER_CHANNEL"] and not scale_weights,
        BLOCK_M=block_m, BLOCK_N=block_n, SWAP_AB=bool(cfg.get("swap_ab", False)), STAGES=cfg.get("num_stages", 2),
        FULL_TILE=bool(cfg.get("full_tile", False)),
        # The interpreter computes bf16 dots wrongly (triton 3.9): it gets fp32 operands instead.
        UPCAST=_interpreting() and x.dtype == torch.bfloat16,
        PACKED=packed, SCALE_WEIGHTS=scale_weights,
        num_warps=cfg.get("num_warps", 4),
    )
    if splits > 1:
        _reduce_splits(target, bias, out, n)


def dequantize(qweight, scales, zeros, codebook, n, k, group_size, dtype, out=None) -> torch.Tensor:
    """Dequantized weight ``[n, k]`` in stored K order (rows of a chunk when qweight is a row slice)."""
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    num_tiles = qweight.shape[1] // WORDS_PER_TILE
    block_n, tiles = 32, 4
    flags = _format_flags(zeros, codebook, group_size)
    del flags["SUBG"]
    grid = (triton.cdiv(n, block_n), triton.cdiv(num_tiles, tiles))
    _dequant_kernel[grid](
        qweight, scales, _or(zeros, scales),
        _or(codebook, scales), out,
        n, k, num_tiles, qweight.shape[1] * 8 if group_size == -1 else group_size,
        qweight.stride(0), scales.stride(0), out.stride(0),
        **flags, BLOCK_N=block_n, TILES=tiles, num_warps=4,
    )
    return out


def _launch_dequant_matmul(x, qweight, scales, zeros, codebook, bias, out, n, k, group_size, cfg) -> None:
    """Dequantize (in row chunks of `chunk_n`, so the fp16 copy can stay in L2) and multiply with cuBLAS."""
    chunk = cfg.get("chunk_n") or n
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        weight = dequantize(qweight[start:], scales[:, start:], None if zeros is None else zeros[:, start:],
                            codebook, stop - start, k, group_size, x.dtype)
        target = out[:, start:stop]
        if bias is None:
            torch.mm(x, weight.t(), out=target)
        else:
            torch.addmm(bias[start:stop], x, weight.t(), out=target)


_LAUNCHERS = {"gemv": _launch_gemv, "dot": _launch_dot, "dequant": _launch_dequant_matmul}


def matmul(x, qweight, scales, zeros, codebook, bias, n, k, group_size, config, out=None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for x ``[M, K]`` with unit column stride, already in stored K order."""
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    _LAUNCHERS[config["kernel"]](x, qweight, scales, zeros, codebook, bias, out, n, k, group_size, config)
    return out
