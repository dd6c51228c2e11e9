"""4-bit experts: the w4a16 weight format, stacked per expert, and round-to-nearest quantization.

moe-dispatch is a standalone Hub package and cannot import w4a16, so this module carries its own copy of
that package's format contract (w4a16/formats.py); tests/test_moe_dispatch_quantized.py builds the same
weights through both packages and checks that they agree bit for bit. One expert's matrix [N, K] (gate/up:
[2I, H], gate rows then up rows as in transformers' layout; down: [H, I]) is stored as:

- ``qweight`` int32 ``[Np, Kp // 8]``: N padded to a multiple of 128 (``Np``), K to a multiple of 128 (``Kp``).
  K is cut into tiles of 128; tile t of row n is 16 consecutive words, and nibble j (bits 4j..4j+3) of word c
  holds the 4-bit code of column ``k = 128 t + 16 j + c``.
- ``scales`` ``[G, Np]`` (float16 / bfloat16 / float32): one per group of ``group_size`` K-columns and row
  (``G = Kp / group_size``, padding groups included; per channel, ``group_size=-1``: ``G = 1``). NF4: the absmax.
- ``zeros`` uint8 ``[G, Np]`` or None: integer zero points (int4); without them int4 is symmetric (zero 8).
- ``mins`` ``[G, Np]`` (the scales' dtype) or None: int4 ``code * scale + min`` (GGUF Q4_1 / Q4_K); never with
  zeros, only with scale groups.
- ``codebook`` float32 ``[16]`` for NF4 (code -> value in [-1, 1]), None for int4.

`QuantizedExperts` stacks E such matrices: ``qweight [E, Np, Kp // 8]``, ``scales / zeros / mins [E, G, Np]``
and one codebook shared by all experts. Dequantized: int4 ``(q - zero) * scale`` or ``q * scale + min``, NF4
``codebook[q] * scale``; padding has scale 0 (and min 0). Act-order permutations (w4a16's ``perm``) are not
part of this format.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

TILE_K = 128  # K-columns per packed tile
WORDS_PER_TILE = TILE_K // 8
PAD_N = 128  # rows are padded to this
FORMATS = ("int4", "nf4")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The NF4 data type of bitsandbytes / QLoRA, as w4a16 stores it.
NF4_CODEBOOK = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

# The tensors of a QuantizedExperts, in the order the ops take them (then group_size).
FIELDS = ("qweight", "scales", "zeros", "mins", "codebook")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def check_group_size(group_size, k: int, name: str = "group_size") -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise TypeError(f"{name} must be an int, got {type(group_size).__name__}")
    if group_size == -1:
        return
    if group_size not in (32, 64) and (group_size <= 0 or group_size % TILE_K):
        raise ValueError(f"{name} must be 32, 64, a multiple of {TILE_K}, or -1 (per channel), got {group_size}")
    if k % group_size:
        raise ValueError(f"{name}: K = {k} (the input features) is not divisible by group_size = {group_size}")


def num_groups(k: int, group_size: int) -> int:
    """Rows of `scales` / `zeros` / `mins` per expert (padding groups included)."""
    return 1 if group_size == -1 else round_up(k, TILE_K) // group_size


@dataclass
class QuantizedExperts:
    """E experts' 4-bit weights of one shape ``(N, K)`` per expert (``shape``): w_gate_up (2I, H) or w_down (H, I).

    Made by `quantize_experts` (round to nearest) or from tensors in the layout above. ``dtype`` is the float
    dtype `dequantize` returns by default (the original weights'); kernels compute in the activations' dtype.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    group_size: int
    fmt: str = "int4"
    zeros: Optional[torch.Tensor] = None
    mins: Optional[torch.Tensor] = None
    codebook: Optional[torch.Tensor] = None
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in FIELDS:
            t = getattr(self, name)
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not isinstance(self.qweight, torch.Tensor) or not isinstance(self.scales, torch.Tensor):
            raise TypeError("qweight and scales must be torch.Tensors")
        if not isinstance(self.shape, (tuple, list)) or len(self.shape) != 2:
            raise ValueError(f"shape must be (N, K), got {self.shape!r}")
        self.shape = tuple(int(s) for s in self.shape)
        n, k = self.shape
        if n <= 0 or k <= 0:
            raise ValueError(f"shape must be two positive sizes (N, K), got {self.shape}")
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {self.fmt!r}")
        check_group_size(self.group_size, k)
        if self.dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {self.dtype}")
        np_, kp = self.padded_shape
        g = num_groups(k, self.group_size)
        if (self.qweight.dtype != torch.int32 or self.qweight.dim() != 3
                or tuple(self.qweight.shape[1:]) != (np_, kp // 8)):
            raise ValueError(f"qweight must be int32 of shape [E, {np_}, {kp // 8}] for experts of shape {self.shape}, "
                             f"got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        experts = self.qweight.shape[0]
        if experts == 0:
            raise ValueError("qweight holds no experts (E = 0)")
        if self.scales.dtype not in FLOAT_DTYPES or tuple(self.scales.shape) != (experts, g, np_):
            raise ValueError(f"scales must be a float tensor of shape {[experts, g, np_]}, got {self.scales.dtype} "
                             f"{tuple(self.scales.shape)}")
        if self.zeros is not None:
            if self.fmt != "int4":
                raise ValueError("zeros (zero points) apply to fmt='int4' only")
            if self.zeros.dtype != torch.uint8 or tuple(self.zeros.shape) != (experts, g, np_):
                raise ValueError(f"zeros must be uint8 of shape {[experts, g, np_]}, got {self.zeros.dtype} "
                                 f"{tuple(self.zeros.shape)}")
        if self.mins is not None:
            if self.fmt != "int4" or self.zeros is not None:
                raise ValueError("mins (float minima) apply to fmt='int4' without zeros only")
            if self.group_size == -1:
                raise ValueError("mins need scale groups (group_size 32, 64 or a multiple of 128), not per channel")
            if self.mins.dtype != self.scales.dtype or tuple(self.mins.shape) != (experts, g, np_):
                raise ValueError(f"mins must have the scales' dtype ({self.scales.dtype}) and shape "
                                 f"{[experts, g, np_]}, got {self.mins.dtype} {tuple(self.mins.shape)}")
        if (self.fmt == "nf4") != (self.codebook is not None):
            raise ValueError("codebook must be given for fmt='nf4' and only for it")
        if self.codebook is not None and (self.codebook.dtype != torch.float32 or tuple(self.codebook.shape) != (16,)):
            raise ValueError(f"codebook must be float32 of shape (16,), got {self.codebook.dtype} "
                             f"{tuple(self.codebook.shape)}")
        device = self.qweight.device
        for name in FIELDS:
            t = getattr(self, name)
            if t is not None and t.device != device:
                raise ValueError(f"{name} is on {t.device} but qweight is on {device}: all tensors must share a device")
            if t is not None and not t.is_contiguous():
                setattr(self, name, t.contiguous())

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def padded_shape(self) -> tuple[int, int]:
        n, k = self.shape
        return round_up(n, PAD_N), round_up(k, TILE_K)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that exist (None fields left out), by field name."""
        return {name: getattr(self, name) for name in FIELDS if getattr(self, name) is not None}

    def expert_nbytes(self) -> int:
        """Bytes one expert's matmul reads: packed codes, scales, zero points or minima (not the codebook)."""
        return sum(t[0].numel() * t.element_size() for name, t in self.tensors().items() if name != "codebook")

    def nbytes(self) -> int:
        return self.num_experts * self.expert_nbytes()

    def to(self, device) -> "QuantizedExperts":
        return replace(self, **{name: t.to(device) for name, t in self.tensors().items()})

    def experts(self, index) -> "QuantizedExperts":
        """The experts `index` (a slice, e.g. an expert-parallel shard) as a QuantizedExperts (views)."""
        if not isinstance(index, slice):
            raise TypeError(f"index must be a slice of experts, got {type(index).__name__}")
        return replace(self, **{name: t[index] for name, t in self.tensors().items() if name != "codebook"})

    def flat(self) -> tuple:
        """(qweight, scales, zeros, mins, codebook, group_size): the op arguments of these weights."""
        return self.qweight, self.scales, self.zeros, self.mins, self.codebook, self.group_size


def from_flat(qweight, scales, zeros, mins, codebook, group_size: int, shape: tuple[int, int],
              dtype: torch.dtype) -> QuantizedExperts:
    """The inverse of `QuantizedExperts.flat` (the ops rebuild the weights from their arguments)."""
    return QuantizedExperts(qweight=qweight, scales=scales, shape=shape, group_size=group_size,
                            fmt="int4" if codebook is None else "nf4", zeros=zeros, mins=mins, codebook=codebook,
                            dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# Packing (any leading dimensions: [..., N, K])
# ----------------------------------------------------------------------------------------------------


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., N, K]`` (values 0..15) -> ``qweight`` int32 ``[..., Np, Kp // 8]`` in the tiled layout."""
    *lead, n, k = codes.shape
    np_, kp = round_up(n, PAD_N), round_up(k, TILE_K)
    full = torch.zeros(*lead, np_, kp, dtype=torch.uint8, device=codes.device)
    full[..., :n, :k] = codes
    tiles = full.view(*lead, np_, kp // TILE_K, 4, 2, WORDS_PER_TILE)  # [..., n, tile, byte b, nibble of b, c]
    # byte b of word c holds nibbles j = 2b (low) and 2b + 1 (high); four bytes are the word, little-endian: byte
    # arithmetic and one reinterpretation, no 64-bit intermediate
    word_bytes = tiles[..., 0, :] | (tiles[..., 1, :] << 4)  # [..., n, tile, b, c]
    return word_bytes.transpose(-1, -2).contiguous().view(torch.int32).view(*lead, np_, kp // 8)


def pack_k_words(words: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """int32 words ``[..., K / 8, N]`` of 8 consecutive K-codes each (nibble p of word r in column n: the code of
    input column 8 r + p, as GPTQ stores ``qweight``) -> ``qweight`` ``[..., Np, Kp // 8]``, equal to `pack` of
    those codes. Bytes move as bytes: no code matrix and no transpose of one (checkpoint loading)."""
    n, k = shape
    *lead, rows, cols = words.shape
    np_, kp = round_up(n, PAD_N), round_up(k, TILE_K)
    if (rows, cols) == (kp // 8, np_):
        src = words.contiguous()
    else:  # zero codes in the padding, as `pack` (one copy, which also makes it contiguous)
        src = torch.zeros(*lead, kp // 8, np_, dtype=torch.int32, device=words.device)
        src[..., : k // 8, :n] = words
    # source row r = 16 t + 4 b + 2 i + h: tile t, byte b of the target word, its low (i = 0) or high (i = 1)
    # nibble, h = c // 8 of the target word c; byte s of a source word holds its codes p = 2 s and 2 s + 1, the
    # target words c = 8 h + p
    grid = src.view(torch.uint8).view(*lead, kp // TILE_K, 4, 2, 2, np_, 4)
    low, high = grid.select(-4, 0), grid.select(-4, 1)  # [..., t, b, h, n, s]
    even = (low & 0x0F) | (high << 4)  # p = 2 s
    odd = (low >> 4) | (high & 0xF0)  # p = 2 s + 1
    target = torch.stack((even, odd), dim=-1)  # [..., t, b, h, n, s, p % 2]
    d = len(lead)
    order = (*range(d), d + 3, d, d + 2, d + 4, d + 5, d + 1)  # [..., n, t, h, s, p % 2, b]
    return target.permute(order).contiguous().view(torch.int32).view(*lead, np_, kp // 8)


def unpack(qweight: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``qweight [..., Np, Kp // 8]`` -> uint8 codes ``[..., N, K]`` (the inverse of `pack`)."""
    n, k = shape
    *lead, np_, words = qweight.shape
    tiles = qweight.reshape(*lead, np_, words // WORDS_PER_TILE, 1, WORDS_PER_TILE)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device).view(1, 1, 8, 1)
    codes = (tiles >> shifts) & 0xF  # [..., n, tile, j, c]
    return codes.reshape(*lead, np_, -1)[..., :n, :k].to(torch.uint8)


def pad_group_params(values: torch.Tensor, shape: tuple[int, int], group_size: int) -> torch.Tensor:
    """Per-group ``[..., G_real, N]`` -> ``[..., G, Np]`` padded with zeros (padding groups and rows: scale 0)."""
    n, k = shape
    out = values.new_zeros(*values.shape[:-2], num_groups(k, group_size), round_up(n, PAD_N))
    out[..., : values.shape[-2], :n] = values
    return out


# ----------------------------------------------------------------------------------------------------
# Round to nearest (w4a16's `quantize`, batched over experts) and dequantization
# ----------------------------------------------------------------------------------------------------


def _nf4_values(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=device)


def _group_params(w: torch.Tensor, fmt: str, zero_point: bool, dtype: torch.dtype):
    """Scales (in `dtype`) and float zero points (int4 with zero points, else None) of the groups along the
    last dimension of the fp32 values `w`."""
    if fmt == "nf4":
        return w.abs().amax(dim=-1).to(dtype), None
    if zero_point:
        lo = w.amin(dim=-1).clamp(max=0)
        hi = w.amax(dim=-1).clamp(min=0)
        scales = ((hi - lo) / 15).to(dtype)
        safe = torch.where(scales == 0, 1.0, scales.float())
        return scales, torch.round(-lo / safe).clamp(0, 15)
    return (w.abs().amax(dim=-1) / 7.5).to(dtype), None


def _encode(w: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], fmt: str) -> torch.Tensor:
    """The nearest codes (floats 0..15) of fp32 values `w` against the stored `scales` (and `zeros`)."""
    safe = torch.where(scales == 0, 1.0, scales.float())
    if fmt == "nf4":
        codebook = _nf4_values(w.device)
        return torch.bucketize((w / safe).clamp(-1, 1), (codebook[1:] + codebook[:-1]) / 2).float()
    if zeros is not None:
        return (torch.round(w / safe) + zeros).clamp(0, 15)
    return (torch.round(w / safe) + 8).clamp(0, 15)


def quantize(weights: torch.Tensor, *, group_size: int = 128, fmt: str = "int4", zero_point: bool | str = False,
             name: str = "weights") -> QuantizedExperts:
    """Round-to-nearest 4-bit quantization of stacked expert weights ``[E, N, K]``, each expert exactly as
    ``w4a16.quantize`` quantizes an ``[N, K]`` weight.

    int4 symmetric (``zero_point=False``): ``scale = absmax / 7.5``, codes ``round(w / scale) + 8`` clamped to
    0..15. int4 with zero points (``True``): the group range (widened to include 0) over 15 steps, zero point
    ``round(-min / scale)``. int4 with float minima (``"float"``; groups only): the group range over 15 steps,
    the minimum stored as it is, codes ``round((w - min) / scale)``. NF4: ``scale = absmax`` and the nearest NF4
    code of ``w / absmax``. Scales (and minima) are stored in the weights' dtype, codes computed against them.
    """
    if not isinstance(weights, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weights).__name__}")
    if weights.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {weights.dtype}")
    if weights.dim() != 3 or weights.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 3-D [E, N, K] tensor, got {tuple(weights.shape)}")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if not (zero_point is False or zero_point is True or (isinstance(zero_point, str) and zero_point == "float")):
        raise ValueError(f"zero_point must be False, True or 'float', got {zero_point!r}")
    if fmt == "nf4" and zero_point is not False:
        raise ValueError("zero_point applies to fmt='int4' only (NF4 is symmetric by construction)")
    experts, n, k = weights.shape
    check_group_size(group_size, k, f"group_size (for {name})")
    if zero_point == "float" and group_size == -1:
        raise ValueError("zero_point='float' needs scale groups (group_size 32, 64 or a multiple of 128)")
    # experts in chunks: the fp32 copy and the int64 packing buffer of all of a large model's experts at once
    # would take ~6x the bf16 weights' memory
    step = max(1, QUANTIZE_CHUNK_ELEMENTS // (n * k))
    if step < experts:
        parts = [_quantize(weights[e:e + step], group_size, fmt, zero_point, name) for e in range(0, experts, step)]
        first = parts[0]
        joined = {field: torch.cat([getattr(p, field) for p in parts])
                  for field in ("qweight", "scales", "zeros", "mins") if getattr(first, field) is not None}
        return replace(first, **joined)
    return _quantize(weights, group_size, fmt, zero_point, name)


QUANTIZE_CHUNK_ELEMENTS = 2**27  # weights quantized per step (fp32 copy 512 MB, packing buffer 1 GB)


def _quantize(weights: torch.Tensor, group_size: int, fmt: str, zero_point, name: str) -> QuantizedExperts:
    if not torch.isfinite(weights).all():
        raise ValueError(f"{name} holds inf or NaN values, which have no 4-bit code")
    experts, n, k = weights.shape
    w = weights.detach().float()
    w = w.view(experts, n, 1, k) if group_size == -1 else w.view(experts, n, k // group_size, group_size)
    zeros = mins = codebook = None
    if zero_point == "float":
        lo = w.amin(dim=-1)
        scales = ((w.amax(dim=-1) - lo) / 15).to(weights.dtype)
        mins = lo.to(weights.dtype)
        safe = torch.where(scales == 0, 1.0, scales.float()).unsqueeze(-1)
        codes = torch.round((w - mins.float().unsqueeze(-1)) / safe).clamp(0, 15)
    else:
        scales, zeros = _group_params(w, fmt, zero_point, weights.dtype)
        codes = _encode(w, scales.unsqueeze(-1), None if zeros is None else zeros.unsqueeze(-1), fmt)
        if fmt == "nf4":
            codebook = _nf4_values(weights.device)

    def params(t: Optional[torch.Tensor], dtype=None) -> Optional[torch.Tensor]:  # [E, N, G] -> [E, G, Np]
        return None if t is None else pad_group_params(t.transpose(1, 2).to(dtype or t.dtype), (n, k), group_size)

    return QuantizedExperts(qweight=pack(codes.reshape(experts, n, k).to(torch.uint8)), scales=params(scales),
                            shape=(n, k), group_size=group_size, fmt=fmt, zeros=params(zeros, torch.uint8),
                            mins=params(mins), codebook=codebook, dtype=weights.dtype)


def quantize_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, *, group_size: int = 128, fmt: str = "int4",
                     zero_point: bool | str = False) -> tuple[QuantizedExperts, QuantizedExperts]:
    """Round-to-nearest 4-bit experts from float ``w_gate_up [E, 2I, H]`` and ``w_down [E, H, I]`` (see
    `quantize`; both with the same scheme). Returns (w_gate_up, w_down) as `QuantizedExperts` for
    `fused_experts` / `moe_forward`."""
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
    experts, two_i, hidden = w_gate_up.shape
    if two_i % 2 or w_down.shape != (experts, hidden, two_i // 2):
        raise ValueError(f"w_gate_up [E, 2I, H] {tuple(w_gate_up.shape)} and w_down [E, H, I] {tuple(w_down.shape)} "
                         f"do not match")
    kw = dict(group_size=group_size, fmt=fmt, zero_point=zero_point)
    return quantize(w_gate_up, name="w_gate_up", **kw), quantize(w_down, name="w_down", **kw)


def dequantize_fp32(qe: QuantizedExperts, experts=slice(None)) -> torch.Tensor:
    """fp32 ``[E', N, K]`` of the experts `experts` (a slice or an index tensor)."""
    n, k = qe.shape
    codes = unpack(qe.qweight[experts], (n, k)).long()
    group_of_col = torch.arange(k, device=qe.device) // (k if qe.group_size == -1 else qe.group_size)

    def per_column(t: torch.Tensor) -> torch.Tensor:  # [E', G, Np] -> [E', N, K]
        return t[experts][:, :, :n][:, group_of_col].transpose(1, 2)

    scale = per_column(qe.scales).float()
    if qe.codebook is not None:
        return qe.codebook.float()[codes] * scale
    if qe.mins is not None:
        return codes * scale + per_column(qe.mins).float()
    zero = 8 if qe.zeros is None else per_column(qe.zeros).long()
    return (codes - zero) * scale


def dequantize(qe: QuantizedExperts, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The float experts ``[E, N, K]`` in `dtype` (default: the weights' ``dtype``)."""
    if not isinstance(qe, QuantizedExperts):
        raise TypeError(f"qe must be a QuantizedExperts, got {type(qe).__name__}")
    return dequantize_fp32(qe).to(dtype or qe.dtype)


def quantize_experts_module(module, *, group_size: int = 128, fmt: str = "int4", zero_point: bool | str = False):
    """A transformers `*Experts` module (gate_up_proj [E, 2I, H], down_proj [E, H, I]) quantized in place: both
    parameters replaced by `QuantizedExperts` (round to nearest), which `experts_forward` / the `MoEExperts`
    layer run in 4 bits. Only moe-dispatch's forward can run the module afterwards (register it through
    `ExpertsInterface` or kernelize first); `module.to(...)` does not move the plain attributes. Returns `module`."""
    for name in ("gate_up_proj", "down_proj"):
        if not isinstance(getattr(module, name, None), torch.Tensor):
            raise TypeError(f"module: {type(module).__name__}.{name} must be a float tensor to quantize, got "
                            f"{type(getattr(module, name, None)).__name__}")
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        raise ValueError(f"module: {type(module).__name__} must hold gate_up_proj [E, 2I, H] and down_proj [E, H, I]")

    def local(t: torch.Tensor) -> torch.Tensor:  # a DTensor's local shard (transformers' expert parallelism)
        to_local = getattr(t, "to_local", None)
        return (to_local() if callable(to_local) else t).detach()

    gate_up, down = quantize_experts(local(module.gate_up_proj), local(module.down_proj), group_size=group_size,
                                     fmt=fmt, zero_point=zero_point)
    for name, value in (("gate_up_proj", gate_up), ("down_proj", down)):
        delattr(module, name)
        setattr(module, name, value)
    return module
