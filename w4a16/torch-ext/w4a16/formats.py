"""The quantized-weight format: its layout, quantize / dequantize helpers, the NF4 codebook, save / load.

Layout (chosen so that one 128-bit load feeds the GEMV inner loop directly):

- ``qweight`` int32 ``[Np, Kp // 8]``, row n = output feature n, K padded to a multiple of 128 (``Kp``) and
  N to a multiple of 128 (``Np``). K is cut into tiles of 128; tile t of row n is 16 consecutive words,
  and nibble j (bits 4j..4j+3) of word c holds the 4-bit code of column ``k = 128 t + 16 j + c``.
  So a kernel that loads the 16 words of a tile (four 128-bit loads) gets, for each nibble position j,
  a contiguous run of 16 K-columns: no shuffles, and x is read in contiguous runs too.
- ``scales`` ``[G, Np]`` (float16 / bfloat16 / float32): one scale per group of ``group_size`` K-columns
  and output row; per-channel quantization (``group_size=-1``) has ``G = 1``. For NF4 it is the block absmax.
- ``zeros`` uint8 ``[G, Np]`` or None: integer zero points (int4 with zero points). Without it int4 is
  symmetric with the implicit zero point 8. Zero points may be 16 (GPTQ v1 checkpoints store zero - 1).
- ``mins`` ``[G, Np]`` (the scales' dtype) or None: int4 with a float minimum per group instead of a zero point, the value
  of code 0 (GGUF's Q4_1 and Q4_K blocks: ``scale * q + min``); never together with ``zeros``, and only with
  scale groups (not per channel).
- ``codebook`` float32 ``[16]`` for NF4 (code -> value in [-1, 1]), None for int4.
- ``perm`` int64 ``[K]`` or None: act-order checkpoints store input channels sorted by group; the
  matmul reads ``x[..., perm]``.

Dequantized weight: int4 ``(q - zero) * scale``, or ``q * scale + min`` with mins; NF4 ``codebook[q] * scale``;
padding has scale 0 (and min 0).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from typing import Optional

import torch

TILE_K = 128  # K-columns per packed tile
WORDS_PER_TILE = TILE_K // 8
PAD_N = 128  # output rows are padded to this so kernels never mask weight loads
# A fused gate / up weight for the SwiGLU epilogue (`ops.swiglu_matmul`) holds its rows in blocks of this many
# gate rows, then as many up rows (`reference.join_gate_up`): every output tile of >= 16 rows pairs gate row
# 16 b + i with up row 16 b + 8 + i, and the MMA accumulator layouts give rows r and r + 8 to one thread.
GATE_UP_BLOCK = 8
FORMATS = ("int4", "nf4")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The NF4 data type of bitsandbytes / QLoRA (quantiles of N(0, 1) normalized to [-1, 1]).
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

# The tensors of a QuantizedWeight, in the order the ops take them.
FIELDS = ("qweight", "scales", "zeros", "mins", "codebook", "perm")
_SAFETENSORS_KEY = "w4a16"
# Version 2: a weight with mins (older kernels, which read version 1 only, refuse it instead of dropping them).
_FORMAT_VERSIONS = (1, 2)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def check_group_size(group_size: int, k: int) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size == -1:
        return
    if group_size not in (32, 64) and (group_size <= 0 or group_size % TILE_K):
        raise ValueError(f"group_size must be 32, 64, a multiple of {TILE_K}, or -1 (per channel), got {group_size}")
    if k % group_size:
        raise ValueError(f"K = {k} (in_features) is not divisible by group_size = {group_size}")


def check_swiglu_rows(n: int) -> None:
    """A fused gate / up weight of `n` rows pairs in the SwiGLU layout only as whole blocks of GATE_UP_BLOCK gate
    rows and as many up rows."""
    if n % (2 * GATE_UP_BLOCK):
        raise ValueError(f"qweight must have a multiple of {2 * GATE_UP_BLOCK} rows (out_features) for the SwiGLU "
                         f"epilogue (gate and up rows in blocks of {GATE_UP_BLOCK}), got {n}")


def num_groups(k: int, group_size: int) -> int:
    """Rows of `scales` / `zeros` for a weight with `k` input features (padding groups included)."""
    return 1 if group_size == -1 else round_up(k, TILE_K) // group_size


@dataclass
class QuantizedWeight:
    """A 4-bit weight of an ``nn.Linear`` with ``shape = (out_features, in_features) = (N, K)``."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    codebook: Optional[torch.Tensor]
    perm: Optional[torch.Tensor]
    shape: tuple[int, int]
    group_size: int
    fmt: str
    dtype: torch.dtype
    mins: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
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
        device = self.qweight.device
        if self.qweight.dtype != torch.int32 or tuple(self.qweight.shape) != (np_, kp // 8):
            raise ValueError(f"qweight must be int32 of shape {(np_, kp // 8)}, got {self.qweight.dtype} "
                             f"{tuple(self.qweight.shape)}")
        if self.scales.dtype not in FLOAT_DTYPES or tuple(self.scales.shape) != (g, np_):
            raise ValueError(f"scales must be a float tensor of shape {(g, np_)}, got {self.scales.dtype} "
                             f"{tuple(self.scales.shape)}")
        if self.zeros is not None:
            if self.fmt != "int4":
                raise ValueError("zeros (zero points) apply to fmt='int4' only")
            if self.zeros.dtype != torch.uint8 or tuple(self.zeros.shape) != (g, np_):
                raise ValueError(f"zeros must be uint8 of shape {(g, np_)}, got {self.zeros.dtype} "
                                 f"{tuple(self.zeros.shape)}")
        if self.mins is not None:
            if self.fmt != "int4" or self.zeros is not None:
                raise ValueError("mins (float minima) apply to fmt='int4' without zeros only")
            if self.group_size == -1:
                raise ValueError("mins need scale groups (group_size 32, 64 or a multiple of 128), not per channel")
            if self.mins.dtype != self.scales.dtype or tuple(self.mins.shape) != (g, np_):
                raise ValueError(f"mins must have the scales' dtype ({self.scales.dtype}) and shape {(g, np_)}, "
                                 f"got {self.mins.dtype} {tuple(self.mins.shape)}")
        if (self.fmt == "nf4") != (self.codebook is not None):
            raise ValueError("codebook must be given for fmt='nf4' and only for it")
        if self.codebook is not None and (self.codebook.dtype != torch.float32 or tuple(self.codebook.shape) != (16,)):
            raise ValueError(f"codebook must be float32 of shape (16,), got {self.codebook.dtype} "
                             f"{tuple(self.codebook.shape)}")
        if self.perm is not None and (self.perm.dtype != torch.int64 or tuple(self.perm.shape) != (k,)):
            raise ValueError(f"perm must be int64 of shape ({k},), got {self.perm.dtype} {tuple(self.perm.shape)}")
        for name in FIELDS:
            t = getattr(self, name)
            if t is not None and t.device != device:
                raise ValueError(f"{name} is on {t.device} but qweight is on {device}: all tensors must share a device")
            if t is not None and not t.is_contiguous():
                setattr(self, name, t.contiguous())

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

    def nbytes(self) -> int:
        """Bytes a matmul reads for the weight: packed codes, scales, zero points or minima."""
        return sum(t.numel() * t.element_size() for name, t in self.tensors().items() if name != "perm")

    def to(self, device) -> "QuantizedWeight":
        return replace(self, **{name: t.to(device) for name, t in self.tensors().items()})

    def metadata(self) -> dict:
        return {"shape": list(self.shape), "group_size": self.group_size, "fmt": self.fmt,
                "dtype": str(self.dtype).removeprefix("torch."),
                "version": _FORMAT_VERSIONS[0] if self.mins is None else _FORMAT_VERSIONS[1]}


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` (values 0..15) -> ``qweight`` int32 ``[Np, Kp // 8]`` in the tiled layout."""
    n, k = codes.shape
    np_, kp = round_up(n, PAD_N), round_up(k, TILE_K)
    full = torch.zeros(np_, kp, dtype=torch.uint8, device=codes.device)
    full[:n, :k] = codes
    tiles = full.view(np_, kp // TILE_K, 4, 2, WORDS_PER_TILE)  # [n, tile, byte b, nibble of the byte, c]
    # byte b of word c holds nibbles j = 2b (low) and 2b + 1 (high); four bytes are the word, little-endian: byte
    # arithmetic and one reinterpretation, no 64-bit intermediate (a quarter of the memory traffic of shifts in int64)
    word_bytes = tiles[:, :, :, 0] | (tiles[:, :, :, 1] << 4)  # [n, tile, b, c]
    return word_bytes.permute(0, 1, 3, 2).contiguous().view(torch.int32).view(np_, kp // 8)


def pack_k_words(words: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """int32 words ``[K / 8, N]`` of 8 consecutive K-codes each (nibble p of word r in column n: the code of input
    column 8 r + p, as GPTQ stores ``qweight``) -> ``qweight`` ``[Np, Kp // 8]``, equal to `pack` of those codes.
    Bytes move as bytes: no code matrix and no transpose of one (checkpoint loading)."""
    n, k = shape
    np_, kp = round_up(n, PAD_N), round_up(k, TILE_K)
    if tuple(words.shape) == (kp // 8, np_):
        src = words.contiguous()
    else:  # zero codes in the padding, as `pack` (one copy, which also makes it contiguous)
        src = torch.zeros(kp // 8, np_, dtype=torch.int32, device=words.device)
        src[: k // 8, :n] = words
    # source row r = 16 t + 4 b + 2 i + h: tile t, byte b of the target word, its low (i = 0) or high (i = 1)
    # nibble, h = c // 8 of the target word c; byte s of a source word holds its codes p = 2 s and 2 s + 1, the
    # target words c = 8 h + p
    grid = src.view(torch.uint8).view(kp // TILE_K, 4, 2, 2, np_, 4)
    low, high = grid[:, :, 0], grid[:, :, 1]  # [t, b, h, n, s]
    even = (low & 0x0F) | (high << 4)  # p = 2 s
    odd = (low >> 4) | (high & 0xF0)  # p = 2 s + 1
    target = torch.stack((even, odd), dim=-1)  # [t, b, h, n, s, p % 2]
    return target.permute(3, 0, 2, 4, 5, 1).contiguous().view(torch.int32).view(np_, kp // 8)


def unpack(qweight: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``qweight`` -> uint8 codes ``[N, K]`` (the inverse of `pack`)."""
    n, k = shape
    np_, words = qweight.shape
    tiles = qweight.view(np_, words // WORDS_PER_TILE, 1, WORDS_PER_TILE)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device).view(1, 1, 8, 1)
    codes = (tiles >> shifts) & 0xF  # [n, tile, j, c]
    return codes.reshape(np_, -1)[:n, :k].to(torch.uint8)


def pad_group_params(values: torch.Tensor, shape: tuple[int, int], group_size: int) -> torch.Tensor:
    """Per-group ``[G_real, N]`` -> ``[G, Np]`` padded with zeros (padding groups and rows get scale 0)."""
    n, k = shape
    out = values.new_zeros(num_groups(k, group_size), round_up(n, PAD_N))
    out[: values.shape[0], :n] = values
    return out


def from_codes(codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], *, group_size: int,
               fmt: str, dtype: torch.dtype, codebook: Optional[torch.Tensor] = None,
               perm: Optional[torch.Tensor] = None, mins: Optional[torch.Tensor] = None) -> "QuantizedWeight":
    """A `QuantizedWeight` from 4-bit codes ``[N, K]`` and per-group scales (and zero points or minima)
    ``[groups, N]``: packs the codes and pads the group parameters into this kernel's layout."""
    return from_packed(pack(codes.to(torch.uint8)), tuple(codes.shape), scales, zeros, group_size=group_size,
                       fmt=fmt, dtype=dtype, codebook=codebook, perm=perm, mins=mins)


def from_packed(qweight: torch.Tensor, shape: tuple[int, int], scales: torch.Tensor, zeros: Optional[torch.Tensor],
                *, group_size: int, fmt: str, dtype: torch.dtype, codebook: Optional[torch.Tensor] = None,
                perm: Optional[torch.Tensor] = None, mins: Optional[torch.Tensor] = None) -> "QuantizedWeight":
    """`from_codes` with the codes already packed (``qweight`` ``[Np, Kp // 8]`` of a weight of `shape`)."""
    n, k = shape
    return QuantizedWeight(
        qweight=qweight,
        scales=pad_group_params(scales, (n, k), group_size),
        zeros=None if zeros is None else pad_group_params(zeros.to(torch.uint8), (n, k), group_size),
        codebook=codebook,
        perm=perm,
        shape=(n, k),
        group_size=group_size,
        fmt=fmt,
        dtype=dtype,
        mins=None if mins is None else pad_group_params(mins, (n, k), group_size),
    )


def take_rows(qw: QuantizedWeight, order: torch.Tensor) -> QuantizedWeight:
    """The weight whose output row i is row ``order[i]`` of `qw` (`order`: a permutation of its N rows). Rows are
    independent in this layout (groups run along K), so packed rows, scales, zero points and minima move as
    they are."""
    n, k = qw.shape
    qweight = qw.qweight.clone()
    qweight[:n] = qw.qweight[order]

    def columns(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else pad_group_params(t[:, order], (n, k), qw.group_size)

    return replace(qw, qweight=qweight, scales=columns(qw.scales), zeros=columns(qw.zeros), mins=columns(qw.mins))


def _group_view(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = weight.shape
    return weight.view(n, 1, k) if group_size == -1 else weight.view(n, k // group_size, group_size)


def quantize(weight: torch.Tensor, *, group_size: int = 128, zero_point: bool | str = False,
             fmt: str = "int4") -> QuantizedWeight:
    """Round-to-nearest quantization of a float weight ``[N, K]`` (``nn.Linear.weight``) to 4 bits.

    int4 symmetric (``zero_point=False``): ``scale = absmax / 7.5``, codes ``round(w / scale) + 8`` clamped to
    0..15. int4 with zero points (``True``): the group range (widened to include 0) over 15 steps, zero point
    ``round(-min / scale)``. int4 with float minima (``"float"``, GGUF Q4_1's scheme; groups, not per channel):
    the group range over 15 steps, the minimum stored as it is (`QuantizedWeight.mins`), codes
    ``round((w - min) / scale)``. NF4: ``scale = absmax`` and the nearest NF4 code of ``w / absmax``.
    Scales (and minima) are stored in the weight's dtype and codes are computed against the stored values.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"weight must be float16, bfloat16 or float32, got {weight.dtype}")
    if weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"weight must be a non-empty 2-D [out_features, in_features] tensor, got {tuple(weight.shape)}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if zero_point not in (False, True, "float"):
        raise ValueError(f"zero_point must be False, True or 'float', got {zero_point!r}")
    if fmt == "nf4" and zero_point:
        raise ValueError("zero_point applies to fmt='int4' only (NF4 is symmetric by construction)")
    n, k = weight.shape
    check_group_size(group_size, k)
    if zero_point == "float" and group_size == -1:
        raise ValueError("zero_point='float' needs scale groups (group_size 32, 64 or a multiple of 128)")
    if not torch.isfinite(weight).all():
        raise ValueError("weight holds inf or NaN values, which have no 4-bit code")
    w = _group_view(weight.detach().float(), group_size)  # [N, G, g]
    if zero_point == "float":
        lo = w.amin(dim=-1)
        scales = ((w.amax(dim=-1) - lo) / 15).to(weight.dtype)
        mins = lo.to(weight.dtype)
        safe = torch.where(scales == 0, 1.0, scales.float()).unsqueeze(2)
        codes = torch.round((w - mins.float().unsqueeze(2)) / safe).clamp(0, 15)
        return from_codes(codes.reshape(n, k), scales.t(), None, group_size=group_size, fmt=fmt, dtype=weight.dtype,
                          mins=mins.t())
    scales, zeros = group_params(w, fmt=fmt, zero_point=zero_point, dtype=weight.dtype)
    codes = encode(w, scales.unsqueeze(2), None if zeros is None else zeros.unsqueeze(2), fmt=fmt)
    codebook = torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=weight.device) if fmt == "nf4" else None
    return from_codes(codes.reshape(n, k), scales.t(), None if zeros is None else zeros.t(), group_size=group_size,
                      fmt=fmt, dtype=weight.dtype, codebook=codebook)


@functools.lru_cache(maxsize=None)
def _nf4_values(device: torch.device) -> torch.Tensor:
    """NF4_CODEBOOK as a float32 tensor on `device`, made once (GPTQ encodes and decodes column by column);
    read only: a weight's own `codebook` is a fresh tensor."""
    return torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=device)


def group_params(w: torch.Tensor, *, fmt: str, zero_point: bool, dtype: torch.dtype):
    """Round-to-nearest parameters of the groups along `w`'s last dimension (fp32 values): the scales, stored in
    `dtype`, and the zero points (float codes 0..15, int4 with zero points only, else None). See `quantize`."""
    if fmt == "nf4":
        return w.abs().amax(dim=-1).to(dtype), None
    if zero_point:
        lo = w.amin(dim=-1).clamp(max=0)
        hi = w.amax(dim=-1).clamp(min=0)
        scales = ((hi - lo) / 15).to(dtype)
        safe = torch.where(scales == 0, 1.0, scales.float())
        return scales, torch.round(-lo / safe).clamp(0, 15)
    return (w.abs().amax(dim=-1) / 7.5).to(dtype), None


def encode(w: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], *, fmt: str) -> torch.Tensor:
    """The nearest 4-bit codes (as floats 0..15) of fp32 values `w` against stored `scales` (and `zeros`), which
    broadcast against `w`."""
    safe = torch.where(scales == 0, 1.0, scales.float())
    if fmt == "nf4":
        codebook = _nf4_values(w.device)
        return torch.bucketize((w / safe).clamp(-1, 1), (codebook[1:] + codebook[:-1]) / 2).float()
    if zeros is not None:
        return (torch.round(w / safe) + zeros).clamp(0, 15)
    return (torch.round(w / safe) + 8).clamp(0, 15)


def decode(codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], *, fmt: str) -> torch.Tensor:
    """The fp32 values of 4-bit `codes` (the dequantized weight): NF4 ``codebook[q] * scale``, int4
    ``(q - zero) * scale`` (zero 8 when symmetric)."""
    if fmt == "nf4":
        return _nf4_values(codes.device)[codes.long()] * scales.float()
    return (codes - (8.0 if zeros is None else zeros)) * scales.float()


def save_quantized(weights, path) -> None:
    """Save one `QuantizedWeight` or a ``{name: QuantizedWeight}`` dict to a safetensors file."""
    from safetensors.torch import save_file

    if not isinstance(weights, (QuantizedWeight, dict)):
        raise TypeError(f"weights must be a QuantizedWeight or a dict of them, got {type(weights).__name__}")
    items = {"": weights} if isinstance(weights, QuantizedWeight) else dict(weights)
    tensors, meta = {}, {}
    for name, qw in items.items():
        if not isinstance(qw, QuantizedWeight):
            raise TypeError(f"{name or 'weights'} must be a QuantizedWeight, got {type(qw).__name__}")
        prefix = f"{name}." if name else ""
        for field, t in qw.tensors().items():
            tensors[prefix + field] = t.detach().contiguous().cpu()
        meta[name] = qw.metadata()
    save_file(tensors, str(path), metadata={_SAFETENSORS_KEY: json.dumps(meta, sort_keys=True)})


def load_quantized(path, device="cpu"):
    """Load what `save_quantized` wrote: a `QuantizedWeight`, or a dict of them when saved as a dict."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(device)) as f:
        header = (f.metadata() or {}).get(_SAFETENSORS_KEY)
        if header is None:
            raise ValueError(f"{path} was not written by w4a16.save_quantized (no {_SAFETENSORS_KEY!r} metadata)")
        meta = json.loads(header)
        keys = set(f.keys())
        out = {}
        for name, m in meta.items():
            if m.get("version") not in _FORMAT_VERSIONS:
                raise ValueError(f"{path}: {name or 'weight'} has format version {m.get('version')}, "
                                 f"this kernel reads {' and '.join(map(str, _FORMAT_VERSIONS))}")
            prefix = f"{name}." if name else ""
            fields = {field: f.get_tensor(prefix + field) if prefix + field in keys else None for field in FIELDS}
            out[name] = QuantizedWeight(**fields, shape=tuple(m["shape"]), group_size=m["group_size"],
                                        fmt=m["fmt"], dtype=getattr(torch, m["dtype"]))
    return out[""] if list(out) == [""] else out
