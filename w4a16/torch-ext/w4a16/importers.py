"""Importers: GPTQ, AWQ, compressed-tensors and bitsandbytes-NF4 checkpoint tensors -> this kernel's `QuantizedWeight` layout.

These run once at load time (they may synchronize with the device); the converted weight is exact: the
same codes, scales and zero points, only re-laid out.

- GPTQ: ``qweight`` int32 ``[K/8, N]`` packed along K (nibble i = row 8r + i), ``qzeros`` int32
  ``[G, N/8]`` packed along N, ``scales [G, N]``, optional ``g_idx [K]`` (act-order). ``checkpoint_format
  ="gptq"`` (v1) stores ``zero - 1``; ``"gptq_v2"`` stores the zero itself.
- AWQ: ``qweight`` int32 ``[K, N/8]`` and ``qzeros [G, N/8]`` packed along N with nibble i holding column
  ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``; ``scales [G, N]``; zeros are stored as is.
- compressed-tensors ``pack-quantized`` int4: ``weight_packed`` int32 ``[N, K/8]`` packed along K in
  natural nibble order holding ``q + 8`` for the signed code q, ``weight_scale [N, G]``, optional
  ``weight_zero_point`` int32 ``[N/8, G]`` packed along N the same way, ``weight_shape`` ``(N, K)``.
- bitsandbytes NF4: the flattened ``[N, K]`` weight, two codes per byte with the first in the high nibble,
  one absmax per ``blocksize`` consecutive elements (optionally itself 8-bit quantized: "nested").
- GGUF (ggml) 4-bit blocks, each row of K weights stored as consecutive blocks (`GGUF_BLOCKS`): Q4_0
  (32 weights: fp16 ``d``, 16 bytes of codes; ``d * (q - 8)``), Q4_1 (fp16 ``d`` and ``m``; ``d * q + m``) and
  Q4_K (256 weights: fp16 ``d`` and ``dmin``, 12 bytes of 6-bit sub-block scales ``sc`` and minima ``mn`` for
  8 sub-blocks of 32, 128 bytes of codes; ``d * sc * q - dmin * mn``). In a block of 32 (a Q4_K chunk of
  64), byte i holds element i in its low nibble and element i + 16 (i + 32) in its high one.
"""

from __future__ import annotations

from typing import Optional

import torch

from .formats import (FLOAT_DTYPES, NF4_CODEBOOK, QuantizedWeight, check_group_size, from_codes, from_packed,
                      pack_k_words)

# GGUF 4-bit tensor type -> (weights per block, bytes per block)
GGUF_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column 8c + AWQ_PACK_ORDER[i]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j is in nibble AWQ_UNPACK_ORDER[j]


def _check_tensor(name: str, t, dtypes, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")


def _check_devices(**tensors) -> None:
    present = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        listed = ", ".join(f"{name} on {t.device}" for name, t in present.items())
        raise ValueError(f"all tensors must be on one device, got {listed}")


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: nibble i of each word at index i. From the words' bytes (little-endian:
    byte b holds nibbles 2b and 2b + 1), so no 32-bit intermediate per nibble."""
    word_bytes = packed.contiguous().view(torch.uint8).view(*packed.shape, 4)
    return torch.stack((word_bytes & 0xF, word_bytes >> 4), dim=-1).view(*packed.shape, 8)


def _unpack_along_last(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Words packed along the last dim in natural nibble order -> [..., n] codes."""
    return _nibbles(packed).flatten(-2)[..., :n]


def _group_size_for(k: int, groups: int, name: str) -> int:
    if groups <= 0 or k % groups:
        raise ValueError(f"{name} has {groups} groups, which do not divide K = {k}")
    group_size = -1 if groups == 1 else k // groups
    check_group_size(group_size, k)
    return group_size


def _act_order_perm(g_idx: Optional[torch.Tensor], k: int, groups: int, group_size: int,
                    name: str) -> Optional[torch.Tensor]:
    """The input-column permutation that sorts an act-order group index by group (None when natural)."""
    if g_idx is None:
        return None
    if g_idx.shape[0] != k:
        raise ValueError(f"{name} must have K = {k} entries, got {g_idx.shape[0]}")
    g_idx = g_idx.long()
    natural = torch.arange(k, device=g_idx.device) // (k if group_size == -1 else group_size)
    if torch.equal(g_idx, natural):  # most checkpoints: one comparison (one host sync on a GPU)
        return None
    if bool(((g_idx < 0) | (g_idx >= groups)).any()):
        raise ValueError(f"{name} values must lie in [0, {groups}) (the groups of the scales)")
    counts = torch.bincount(g_idx, minlength=groups)
    if bool((counts != k // groups).any()):
        raise ValueError(f"{name} must assign exactly {k // groups} input channels to each group")
    return torch.argsort(g_idx, stable=True)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: Optional[torch.Tensor] = None, *, sym: bool = True,
              checkpoint_format: str = "gptq") -> QuantizedWeight:
    """Convert a GPTQ 4-bit linear (AutoGPTQ / GPTQModel tensors) to this kernel's layout.

    ``sym=True`` checks that every zero point is 8 (the symmetric "uint4b8" case) and drops them; a
    mismatch usually means the wrong ``checkpoint_format`` (v1 stores 7, v2 stores 8).
    """
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' (v1: zeros stored minus 1) or 'gptq_v2', "
                         f"got {checkpoint_format!r}")
    _check_tensor("qweight", qweight, (torch.int32,), 2)
    _check_tensor("qzeros", qzeros, (torch.int32,), 2)
    _check_tensor("scales", scales, FLOAT_DTYPES, 2)
    if g_idx is not None:
        _check_tensor("g_idx", g_idx, (torch.int32, torch.int64), 1)
    _check_devices(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = scales.shape[0]
    if scales.shape[1] != n:
        raise ValueError(f"scales must have shape [groups, {n}] (N from qweight [K/8, N]), got {tuple(scales.shape)}")
    if tuple(qzeros.shape) != (groups, -(-n // 8)):
        raise ValueError(f"qzeros must have shape {(groups, -(-n // 8))} (groups from scales, N/8 packed), "
                         f"got {tuple(qzeros.shape)}")
    group_size = _group_size_for(k, groups, "scales")
    perm = _act_order_perm(g_idx, k, groups, group_size, "g_idx")
    stored_eight = 0x77777777 if checkpoint_format == "gptq" else -0x77777778  # every nibble 7 (v1) or 8 (v2)
    if sym and n % 8 == 0 and torch.equal(qzeros, torch.full_like(qzeros, stored_eight)):
        zeros = None  # checked on the packed words: no unpacking (checkpoint loading)
    else:
        zeros = _unpack_along_last(qzeros, n)  # [G, N]
        if checkpoint_format == "gptq":
            zeros = zeros + 1
        if sym:
            if not bool((zeros == 8).all()):
                found = sorted(set(zeros.unique().tolist()))[:4]
                raise ValueError(f"sym=True expects every zero point to be 8, got values {found} with "
                                 f"checkpoint_format={checkpoint_format!r}: v1 checkpoints ('gptq') store 7, "
                                 f"v2 ('gptq_v2') store 8; pass the matching format, or sym=False")
            zeros = None
    if perm is None:  # the words re-laid as bytes (`pack_k_words`), no code matrix
        return from_packed(pack_k_words(qweight, (n, k)), (n, k), scales, zeros, group_size=group_size, fmt="int4",
                           dtype=scales.dtype)
    codes = _nibbles(qweight).permute(0, 2, 1).reshape(k, n).t()[:, perm]  # [N, K], columns sorted by group
    return from_codes(codes, scales, zeros, group_size=group_size, fmt="int4", dtype=scales.dtype, perm=perm)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, sym: bool = False) -> QuantizedWeight:
    """Convert an AWQ (AutoAWQ "GEMM" version) 4-bit linear to this kernel's layout.

    ``sym=True`` (checkpoints saved with ``zero_point: false``, which still store zero points, all 8) checks
    that every zero point is 8 and drops them, so the weight takes the symmetric kernels.
    """
    if not isinstance(sym, bool):
        raise TypeError(f"sym must be a bool, got {type(sym).__name__}")
    _check_tensor("qweight", qweight, (torch.int32,), 2)
    _check_tensor("qzeros", qzeros, (torch.int32,), 2)
    _check_tensor("scales", scales, FLOAT_DTYPES, 2)
    _check_devices(qweight=qweight, qzeros=qzeros, scales=scales)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = scales.shape[0]
    if scales.shape[1] != n:
        raise ValueError(f"scales must have shape [groups, {n}] (N = 8 * qweight.shape[1]), got {tuple(scales.shape)}")
    if tuple(qzeros.shape) != (groups, qweight.shape[1]):
        raise ValueError(f"qzeros must have shape {(groups, qweight.shape[1])}, got {tuple(qzeros.shape)}")
    group_size = _group_size_for(k, groups, "scales")
    order = torch.tensor(AWQ_UNPACK_ORDER, device=qweight.device)
    codes = _nibbles(qweight)[..., order].reshape(k, n).t()
    zeros = _nibbles(qzeros)[..., order].reshape(groups, n)
    if sym:
        if not bool((zeros == 8).all()):
            found = sorted(set(zeros.unique().tolist()))[:4]
            raise ValueError(f"sym=True expects every zero point to be 8, got values {found}: pass sym=False")
        zeros = None
    return from_codes(codes, scales, zeros, group_size=group_size, fmt="int4", dtype=scales.dtype)


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_shape,
                            weight_zero_point: Optional[torch.Tensor] = None,
                            weight_g_idx: Optional[torch.Tensor] = None) -> QuantizedWeight:
    """Convert a compressed-tensors ``pack-quantized`` int4 linear (llm-compressor output) to this layout.

    ``weight_shape`` is the stored ``(N, K)`` (a tensor or a pair); ``weight_zero_point`` is given for
    asymmetric schemes and left out for symmetric ones; ``weight_g_idx`` for act-order ("group") checkpoints.
    """
    _check_tensor("weight_packed", weight_packed, (torch.int32,), 2)
    _check_tensor("weight_scale", weight_scale, FLOAT_DTYPES, 2)
    if weight_zero_point is not None:
        _check_tensor("weight_zero_point", weight_zero_point, (torch.int32,), 2)
    if weight_g_idx is not None:
        _check_tensor("weight_g_idx", weight_g_idx, (torch.int32, torch.int64), 1)
    _check_devices(weight_packed=weight_packed, weight_scale=weight_scale, weight_zero_point=weight_zero_point,
                   weight_g_idx=weight_g_idx)
    if isinstance(weight_shape, torch.Tensor):
        weight_shape = weight_shape.tolist()
    if len(tuple(weight_shape)) != 2:
        raise ValueError(f"weight_shape must be (out_features, in_features), got {weight_shape}")
    n, k = (int(s) for s in weight_shape)
    if tuple(weight_packed.shape) != (n, -(-k // 8)):
        raise ValueError(f"weight_packed must have shape {(n, -(-k // 8))} for weight_shape {(n, k)}, "
                         f"got {tuple(weight_packed.shape)}")
    groups = weight_scale.shape[1]
    if weight_scale.shape[0] != n:
        raise ValueError(f"weight_scale must have shape [{n}, groups], got {tuple(weight_scale.shape)}")
    group_size = _group_size_for(k, groups, "weight_scale")
    # Codes are the signed values plus 8, so symmetric weights are exactly this format's implicit zero 8,
    # and (q - zero) of the signed pair equals the difference of the stored nibbles.
    zeros = None
    if weight_zero_point is not None:
        if tuple(weight_zero_point.shape) != (-(-n // 8), groups):
            raise ValueError(f"weight_zero_point must have shape {(-(-n // 8), groups)} (N/8 packed, groups), "
                             f"got {tuple(weight_zero_point.shape)}")
        zeros = _unpack_along_last(weight_zero_point.t(), n)  # [G, N]
    perm = _act_order_perm(weight_g_idx, k, groups, group_size, "weight_g_idx")
    if perm is None and k % 8 == 0:  # whole words of 8 K-codes: re-laid as bytes (`pack_k_words`)
        return from_packed(pack_k_words(weight_packed.t(), (n, k)), (n, k), weight_scale.t(), zeros,
                           group_size=group_size, fmt="int4", dtype=weight_scale.dtype)
    codes = _unpack_along_last(weight_packed, k)
    if perm is not None:
        codes = codes[:, perm]
    return from_codes(codes, weight_scale.t(), zeros, group_size=group_size, fmt="int4", dtype=weight_scale.dtype,
                      perm=perm)


def from_bnb_nf4(weight: torch.Tensor, absmax: torch.Tensor, *, shape, blocksize: int = 64,
                 quant_map: Optional[torch.Tensor] = None, nested_absmax: Optional[torch.Tensor] = None,
                 nested_quant_map: Optional[torch.Tensor] = None, nested_blocksize: int = 256,
                 offset: float = 0.0, dtype: torch.dtype = torch.float16) -> QuantizedWeight:
    """Convert a bitsandbytes NF4 weight (``Params4bit`` data plus its quant state) to this layout.

    ``weight``: the packed storage (uint8, or another quant_storage dtype viewed as bytes); ``absmax``:
    float32 per block, or uint8 codes when the state is nested (``compress_statistics=True``), in which
    case ``nested_absmax``, ``nested_quant_map`` and ``offset`` restore it as bitsandbytes does:
    ``nested_quant_map[absmax] * nested_absmax[block // nested_blocksize] + offset``. ``shape`` is the
    original ``(out_features, in_features)``; ``dtype`` the dtype `dequantize` returns.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if len(tuple(shape)) != 2:
        raise ValueError(f"shape must be (out_features, in_features), got {shape}")
    n, k = (int(s) for s in shape)
    if k % blocksize:
        raise ValueError(f"in_features = {k} must be divisible by blocksize = {blocksize} (blocks within rows)")
    check_group_size(blocksize, k)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    _check_devices(weight=weight, absmax=absmax, quant_map=quant_map, nested_absmax=nested_absmax,
                   nested_quant_map=nested_quant_map)
    data = weight.contiguous().view(torch.uint8).reshape(-1)
    if data.numel() != n * k // 2:
        raise ValueError(f"weight must hold {n * k // 2} bytes for shape {(n, k)}, got {data.numel()}")
    blocks = n * k // blocksize
    if nested_absmax is None:
        _check_tensor("absmax", absmax, (torch.float32, torch.float16, torch.bfloat16), 1)
        block_absmax = absmax.float()
    else:
        _check_tensor("absmax", absmax, (torch.uint8,), 1)
        _check_tensor("nested_absmax", nested_absmax, (torch.float32,), 1)
        if nested_quant_map is None:
            raise ValueError("nested_quant_map is required with nested_absmax (the 8-bit code of the absmax)")
        _check_tensor("nested_quant_map", nested_quant_map, (torch.float32,), 1)
        if nested_absmax.numel() != -(-blocks // nested_blocksize):
            raise ValueError(f"nested_absmax must have {-(-blocks // nested_blocksize)} entries for {blocks} blocks "
                             f"of nested_blocksize {nested_blocksize}, got {nested_absmax.numel()}")
        per_block = nested_absmax.repeat_interleave(nested_blocksize)[:blocks]
        block_absmax = nested_quant_map[absmax.long()] * per_block + offset
    if block_absmax.numel() != blocks:
        raise ValueError(f"absmax must have {blocks} entries (N*K / blocksize), got {block_absmax.numel()}")
    if quant_map is None:
        codebook = torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=data.device)
    else:
        _check_tensor("quant_map", quant_map, (torch.float32,), 1)
        if quant_map.numel() != 16:
            raise ValueError(f"quant_map must have 16 entries (a 4-bit code), got {quant_map.numel()}")
        codebook = quant_map.contiguous()
    codes = torch.stack((data >> 4, data & 0xF), dim=1).reshape(n, k)
    return from_codes(codes, block_absmax.view(n, k // blocksize).t(), None, group_size=blocksize, fmt="nf4",
                      dtype=dtype, codebook=codebook)


def from_gguf(data, tensor_type, shape: tuple[int, int], *, dtype: torch.dtype = torch.float16) -> QuantizedWeight:
    """A GGUF Q4_0, Q4_1 or Q4_K weight ``[N, K]`` (`shape`, out_features first, as transformers holds it) from
    its raw blocks `data` (a uint8 tensor or array of ``N * K / block * bytes`` bytes, such as gguf's
    ``GGUFReader`` tensor ``.data``); `tensor_type` is the type's name or gguf's ``GGMLQuantizationType``.
    Groups of 32: Q4_0 becomes symmetric int4 (zero point 8), Q4_1 and Q4_K int4 with float minima (`mins`).
    `dtype` holds the scales and minima: float16 (the default) and float32 keep Q4_0 and Q4_1 exact, float32 also
    Q4_K's products ``d * sc`` and ``dmin * mn`` (up to 17 significant bits; float16 rounds them once, a relative
    2^-11), bfloat16 rounds all of them."""
    name = getattr(tensor_type, "name", tensor_type)
    if name not in GGUF_BLOCKS:
        raise ValueError(f"tensor_type must be one of {sorted(GGUF_BLOCKS)} (4-bit GGUF), got {name!r}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    if (not isinstance(shape, (tuple, list)) or len(shape) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise ValueError(f"shape must be (N, K), two positive ints, got {shape!r}")
    n, k = shape
    per_block, block_bytes = GGUF_BLOCKS[name]
    if k % per_block:
        raise ValueError(f"a {name} row holds whole blocks of {per_block} weights, but K = {k}")
    raw = data if isinstance(data, torch.Tensor) else torch.from_numpy(_as_numpy_bytes(data))
    if raw.dtype != torch.uint8:
        raise TypeError(f"data must hold uint8 bytes, got {raw.dtype}")
    if raw.numel() != n * (k // per_block) * block_bytes:
        raise ValueError(f"data must hold {n * (k // per_block) * block_bytes} bytes for a {name} weight of shape "
                         f"{(n, k)}, got {raw.numel()}")
    blocks = raw.reshape(n, k // per_block, block_bytes)

    def halves(start: int) -> torch.Tensor:  # the fp16 at byte `start` of every block, as float32 [N, blocks]
        return blocks[..., start:start + 2].contiguous().view(torch.float16)[..., 0].float()

    def codes_of(qs: torch.Tensor, run: int) -> torch.Tensor:  # runs of `run` bytes: low nibbles, then high ones
        runs = qs.unflatten(-1, (-1, run))
        return torch.cat((runs & 0xF, runs >> 4), dim=-1).flatten(-2)

    if name == "Q4_0":
        codes = codes_of(blocks[..., 2:], 16)
        return from_codes(codes.reshape(n, k), halves(0).t().to(dtype), None, group_size=32, fmt="int4", dtype=dtype)
    if name == "Q4_1":
        codes = codes_of(blocks[..., 4:], 16)
        return from_codes(codes.reshape(n, k), halves(0).t().to(dtype), None, group_size=32, fmt="int4",
                          dtype=dtype, mins=halves(2).t().to(dtype))
    packed = blocks[..., 4:16].long()  # 8 six-bit scales and minima per super-block
    low, high = packed[..., :4], packed[..., 8:]
    sc = torch.cat((low & 63, (high & 0xF) | ((low >> 6) << 4)), dim=-1)
    mn = torch.cat((packed[..., 4:8] & 63, (high >> 4) | ((packed[..., 4:8] >> 6) << 4)), dim=-1)
    scales = (halves(0).unsqueeze(-1) * sc).flatten(1)  # exact in float32: an fp16 times a 6-bit integer
    mins = -(halves(2).unsqueeze(-1) * mn).flatten(1)
    codes = codes_of(blocks[..., 16:], 32)
    return from_codes(codes.reshape(n, k), scales.t().to(dtype), None, group_size=32, fmt="int4", dtype=dtype,
                      mins=mins.t().to(dtype))


def _as_numpy_bytes(data):
    """A numpy array (gguf's memory-mapped tensor data) as a writable uint8 copy that torch can wrap."""
    import numpy as np

    if not isinstance(data, np.ndarray):
        raise TypeError(f"data must be a uint8 torch.Tensor or numpy array, got {type(data).__name__}")
    if data.dtype != np.uint8:
        raise TypeError(f"data must hold uint8 bytes, got {data.dtype}")
    return np.array(data, copy=True)
