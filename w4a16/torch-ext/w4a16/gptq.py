"""Calibrated quantization (GPTQ, Frantar et al. 2022): each weight column is rounded in turn and the rounding
error is spread over the columns not yet rounded, weighted by the inverse Hessian ``H = X^T X`` of the layer's
calibration inputs, so that ``X W^T`` moves as little as the 4-bit grid allows.

`gptq_quantize` quantizes one weight from its Hessian (`layers.calibrate_model` collects a model's Hessians
decoder layer by decoder layer and calls it). Group parameters follow `formats.quantize` (round-to-nearest scales,
zero points against the stored scales), computed from the weight as updated when its group is reached.
"""

from __future__ import annotations

import torch

from .formats import FORMATS, NF4_CODEBOOK, QuantizedWeight, check_group_size, decode, encode, from_codes, group_params


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, *, group_size: int = 128, zero_point: bool = False,
                  fmt: str = "int4", act_order: bool = False, damp: float = 0.01) -> QuantizedWeight:
    """GPTQ quantization of a float weight ``[N, K]`` given ``hessian`` ``[K, K]`` (any positive multiple of the
    sum of ``x^T x`` over calibration inputs x). `act_order` rounds columns in order of decreasing Hessian
    diagonal and stores the weight with its input channels in that order (`perm`), so groups follow it.
    `damp` is added to the diagonal as a fraction of its mean. Deterministic: no randomness is involved."""
    if not isinstance(weight, torch.Tensor) or not isinstance(hessian, torch.Tensor):
        raise TypeError("weight and hessian must be torch.Tensors")
    if weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"weight must be a non-empty 2-D [out_features, in_features] tensor, got {tuple(weight.shape)}")
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}] for a weight with {k} input features, got {tuple(hessian.shape)}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if zero_point == "float":
        raise ValueError("zero_point='float' (float minima) is round-to-nearest only (quantize, quantize_model "
                         "without calibration)")
    if fmt == "nf4" and zero_point:
        raise ValueError("zero_point=True applies to fmt='int4' only (NF4 is symmetric by construction)")
    if not 0 <= damp < 1:
        raise ValueError(f"damp must be in [0, 1), got {damp}")
    check_group_size(group_size, k)
    if not (torch.isfinite(weight).all() and torch.isfinite(hessian).all()):
        raise ValueError("weight and hessian must be finite")

    w = weight.detach().float().clone()
    h = hessian.detach().to(device=w.device, dtype=torch.float64).clone()  # Cholesky in float64: stable at any scale
    dead = torch.diagonal(h) == 0  # inputs never seen: their columns contribute nothing
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype, device=h.device)
    # Upper Cholesky factor of H^-1: row i holds how column i's error propagates to the columns after it.
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()

    width = k if group_size == -1 else group_size
    codes = torch.empty_like(w)
    scales, zeros = [], []
    block = max(128, group_size)  # whole groups per block (per channel: 128 columns)
    for start in range(0, k, block):
        stop = min(start + block, k)
        wb = w[:, start:stop].clone()
        err = torch.empty_like(wb)
        for i in range(stop - start):
            col = start + i
            if col % width == 0:  # a group starts: its parameters from the weight as updated so far
                group = wb[:, i:i + width] if group_size != -1 else w
                s, z = group_params(group, fmt=fmt, zero_point=zero_point, dtype=weight.dtype)
                scales.append(s)
                zeros.append(z)
            s, z = scales[-1], zeros[-1]
            q = encode(wb[:, i], s, z, fmt=fmt)
            codes[:, col] = q
            e = (wb[:, i] - decode(q, s, z, fmt=fmt)) / h_inv[col, col]
            wb[:, i:] -= e.unsqueeze(1) * h_inv[col, start + i:stop].unsqueeze(0)
            err[:, i] = e
        w[:, stop:] -= err @ h_inv[start:stop, stop:]
    zero_t = None if zeros[0] is None else torch.stack(zeros)
    codebook = torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=weight.device) if fmt == "nf4" else None
    return from_codes(codes, torch.stack(scales), zero_t, group_size=group_size, fmt=fmt, dtype=weight.dtype,
                      codebook=codebook, perm=perm)
