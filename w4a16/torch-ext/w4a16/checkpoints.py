"""Load a 4-bit checkpoint folder (GPTQ, AWQ GEMM, compressed-tensors pack-quantized) or GGUF file into a model.

`load_checkpoint` takes a model built from the checkpoint's config (on the meta device or the CPU), reads
the folder's quantization config, swaps every quantized ``nn.Linear`` for a `W4A16Linear` built through
the importers (exact: the checkpoint's own codes, scales and zero points) and loads every other tensor.
`from_pretrained` builds the model with transformers first. What the importers cannot represent exactly
is refused with a ValueError naming the config field, never approximated.

Which modules are quantized is read from the tensors (a ``qweight`` or ``weight_packed`` under the
module's name), and group sizes from the scales' shapes: that is what the quantizing tool wrote, so
``modules_to_not_convert`` / ``ignore`` lists and per-module overrides need no pattern matching here.

`load_gguf` takes the model transformers made from a GGUF file (``from_pretrained(..., gguf_file=...)``, which
dequantizes every tensor) and puts the file's 4-bit blocks (Q4_0, Q4_1, Q4_K) back under its linear layers.
"""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from .formats import QuantizedWeight, take_rows
from .importers import GGUF_BLOCKS, from_awq, from_compressed_tensors, from_gguf, from_gptq
from .layers import W4A16Linear, fuse_projections
# The model's dtype is its activations' dtype, which W4A16Linear takes in float16 or bfloat16.
from .ops import ACTIVATION_DTYPES, dequantize
from .quant_config import awq_symmetric, check_compressed_tensors, quantization_config, read_json, require

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# The tensor that marks a quantized linear, per method, and the tensors an importer reads: required, optional.
_MARKER = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}
_PARTS = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "compressed-tensors": (("weight_packed", "weight_scale", "weight_shape"), ("weight_zero_point", "weight_g_idx")),
}


@dataclass(frozen=True)
class Scheme:
    """What `load_checkpoint` read from a folder's quantization config."""

    method: str  # "gptq", "awq" or "compressed-tensors"
    sym: bool = True  # GPTQ / AWQ: every zero point is 8 (checked and dropped by the importer)
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" (v1, zeros stored minus 1) or "gptq_v2"
    weights_file: Optional[str] = None  # AutoGPTQ's model_file_base_name (e.g. gptq_model-4bit-128g)


def _gptq_scheme(qc: dict) -> Scheme:
    bits = qc.get("bits")
    require(bits == 4, "bits", bits, "w4a16 holds 4-bit weights only")
    # AutoGPTQ and transformers write "checkpoint_format", GPTQModel both it and "format": the tensor layout.
    formats = {key: qc[key] for key in ("checkpoint_format", "format") if key in qc}
    for key, value in formats.items():
        require(value in ("gptq", "gptq_v2"), key, value,
                 "only the 'gptq' (v1) and 'gptq_v2' tensor layouts; marlin, bitblas, exllama-repacked, planar "
                 "and other kernel-specific layouts are not read")
    require(len(set(formats.values())) <= 1, "format", formats, "checkpoint_format and format must agree")
    fmt = next(iter(formats.values()), "gptq")
    pack_dtype = qc.get("pack_dtype", "int32")
    require(pack_dtype == "int32", "pack_dtype", pack_dtype, "qweight / qzeros must be packed in int32")
    require(not qc.get("is_marlin_format"), "is_marlin_format", qc.get("is_marlin_format"),
             "AutoGPTQ's marlin-repacked tensors are not read")
    sym = qc.get("sym", True)
    require(isinstance(sym, bool), "sym", sym, "sym must be true or false")
    # GPTQModel's per-module overrides ("dynamic"): "-:" patterns leave modules unquantized (their tensors
    # say so) and group sizes are read from the tensors, but other bits, or another sym than the global one
    # (which decides whether zero points are checked and dropped), would change how tensors decode.
    for pattern, override in (qc.get("dynamic") or {}).items():
        if pattern.startswith("-:") or not isinstance(override, dict):
            continue
        for field, expected in (("bits", 4), ("sym", sym)):
            value = override.get(field, expected)
            require(value == expected, f"dynamic[{pattern!r}].{field}", value,
                     f"per-module overrides must keep {field} = {expected!r}")
    base = qc.get("model_file_base_name")
    return Scheme("gptq", sym=sym, checkpoint_format=fmt, weights_file=None if base is None else f"{base}.safetensors")


def _awq_scheme(qc: dict) -> Scheme:
    return Scheme("awq", sym=awq_symmetric(qc))


def _compressed_tensors_scheme(qc: dict) -> Scheme:
    check_compressed_tensors(qc)
    return Scheme("compressed-tensors")


def read_scheme(folder) -> Scheme:
    """The folder's quantization config as a `Scheme`; a ValueError naming the field for anything the
    loader does not read exactly (other bit widths, kernel-specific layouts, activation quantization)."""
    qc, method = quantization_config(os.fspath(folder))
    readers = {"gptq": _gptq_scheme, "awq": _awq_scheme, "compressed-tensors": _compressed_tensors_scheme}
    require(method in readers, "quant_method", method, f"supported methods are {', '.join(readers)}")
    return readers[method](qc)


def _shard_files(folder: str, scheme: Scheme) -> list[str]:
    index = os.path.join(folder, _INDEX)
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        return [os.path.join(folder, f) for f in sorted(set(weight_map.values()))]
    names = [_SINGLE] if scheme.weights_file is None else [_SINGLE, scheme.weights_file]
    for name in names:
        if os.path.isfile(os.path.join(folder, name)):
            return [os.path.join(folder, name)]
    raise ValueError(f"{folder} has none of {', '.join(names)} and no {_INDEX} (only safetensors checkpoints "
                     f"are read)")


@contextmanager
def _open_shards(files: list[str]):
    """``{tensor name: safe_open handle}`` over all shards (tensors are read one at a time, on demand)."""
    from safetensors import safe_open

    with ExitStack() as stack:
        where = {}
        for path in files:
            handle = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            for name in handle.keys():
                if name in where:
                    raise ValueError(f"tensor {name} is stored in more than one shard")
                where[name] = handle
        yield where


def _import(scheme: Scheme, parts: dict) -> QuantizedWeight:
    if scheme.method == "gptq":
        return from_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), sym=scheme.sym,
                         checkpoint_format=scheme.checkpoint_format)
    if scheme.method == "awq":
        return from_awq(parts["qweight"], parts["qzeros"], parts["scales"], sym=scheme.sym)
    return from_compressed_tensors(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"],
                                   parts.get("weight_zero_point"), parts.get("weight_g_idx"))


def _quantized_linear(model: nn.Module, prefix: str) -> nn.Linear:
    """The model's ``nn.Linear`` that the checkpoint's quantized tensors under `prefix` belong to."""
    if "experts" in prefix.split("."):
        raise ValueError(f"{prefix}: quantized MoE expert tensors are not w4a16 linears; moe-dispatch's "
                         f"load_quantized_experts(model, folder) reads a GPTQ, AWQ or compressed-tensors checkpoint's "
                         f"experts")
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        raise ValueError(f"the checkpoint has quantized tensors for {prefix}, which the model does not have "
                         f"(was it built from this checkpoint's config?)") from None
    if not isinstance(module, nn.Linear):
        raise ValueError(f"the checkpoint quantizes {prefix}, which is a {type(module).__name__} in the model, "
                         f"not an nn.Linear")
    return module


class _HostToDevice:
    """Checkpoint tensors (read on the CPU) onto `device`. To a GPU through two pinned slots of `SLOT_BYTES`,
    reused for every tensor, in slot-sized pieces: the copy engine moves one piece while the host reads the next
    into the other slot (a pageable copy blocks the host for the whole transfer). A slot is refilled only after
    its copy has finished. Fixed slots rather than ``tensor.pin_memory()``: on the H200 (docs/design/w4a16.md,
    run 68) a process's first load that way paid 3.3x the read, pinning new blocks at ~0.5 ms per MB."""

    SLOT_BYTES = 8 << 20

    def __init__(self, device: torch.device):
        self.device = device
        self.slots: list[torch.Tensor] = []  # pinned on first use
        self.copied: list[Optional[torch.cuda.Event]] = [None, None]  # each slot's last copy
        self.turn = 1

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return tensor.to(self.device)
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        source = tensor.contiguous().reshape(-1).view(torch.uint8)
        target = out.reshape(-1).view(torch.uint8)
        for start in range(0, source.numel(), self.SLOT_BYTES):
            piece = min(self.SLOT_BYTES, source.numel() - start)
            self.turn = 1 - self.turn
            slot = self._slot(self.turn)
            slot[:piece].copy_(source[start:start + piece])
            target[start:start + piece].copy_(slot[:piece], non_blocking=True)
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record(torch.cuda.current_stream(self.device))  # the stream copy_ ran on
        return out

    def _slot(self, i: int) -> torch.Tensor:
        """Slot `i`, once its last copy has finished."""
        if i == len(self.slots):
            self.slots.append(torch.empty(self.SLOT_BYTES, dtype=torch.uint8, pin_memory=True))
        elif self.copied[i] is not None:
            self.copied[i].synchronize()
        return self.slots[i]


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def load_checkpoint(model: nn.Module, folder, *, device="cpu", dtype: Optional[torch.dtype] = None,
                    fuse: bool = False) -> nn.Module:
    """Load the quantized checkpoint in `folder` into `model` in place and return it.

    `model` is built from the checkpoint's config (parameters on the meta device or anywhere else).
    Every linear layer the checkpoint quantizes becomes a `W4A16Linear` on `device`; every other tensor
    (embeddings, norms, biases, an unquantized lm_head) is loaded into the model, in `dtype` when given,
    else in the dtype of the model's own parameter. A tied lm_head is tied again through the model's
    ``tie_weights`` when the checkpoint does not store it. Scales keep the checkpoint's dtype (exact).
    With `fuse`, q / k / v and gate / up then run as one matmul each where their formats, group sizes and
    act-order permutations agree (`fuse_projections`; exact).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path (str or os.PathLike), got {type(folder).__name__}")
    if dtype is not None and dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"dtype must be None, torch.float16 or torch.bfloat16, got {dtype!r}")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a torch.device or a device string, got {type(device).__name__}")
    if not isinstance(fuse, bool):
        raise TypeError(f"fuse must be a bool, got {type(fuse).__name__}")
    device = torch.device(device)
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    scheme = read_scheme(folder)
    marker = "." + _MARKER[scheme.method]
    to_device = _HostToDevice(device)
    with _open_shards(_shard_files(folder, scheme)) as where:
        prefixes = sorted(name[: -len(marker)] for name in where if name.endswith(marker))
        if not prefixes:
            raise ValueError(f"{folder} is declared {scheme.method} but stores no '*{marker}' tensors")
        linears = {prefix: _quantized_linear(model, prefix) for prefix in prefixes}
        consumed = set()
        for prefix, linear in linears.items():
            parts = {}
            required, optional = _PARTS[scheme.method]
            for part in required + optional:
                key = f"{prefix}.{part}"
                if key in where:
                    # The re-layout runs where the weight will live: on a GPU it costs little next to the read.
                    parts[part] = to_device(where[key].get_tensor(key))
                    consumed.add(key)
                elif part in required:
                    raise ValueError(f"{prefix}: the checkpoint has no {key} ({scheme.method} needs "
                                     f"{', '.join(required)})")
            try:
                qweight = _import(scheme, parts)
            except ValueError as error:  # group sizes, act-order layouts, zero points the format cannot hold
                raise ValueError(f"{prefix}: {error}") from error
            if qweight.shape != (linear.out_features, linear.in_features):
                raise ValueError(f"{prefix}: the checkpoint's weight is {qweight.shape} (out, in) but the model's "
                                 f"nn.Linear is {(linear.out_features, linear.in_features)}")
            bias_key = f"{prefix}.bias"
            bias = None
            if bias_key in where:
                consumed.add(bias_key)
                bias = where[bias_key].get_tensor(bias_key).to(dtype or linear.weight.dtype)
            elif linear.bias is not None:
                raise ValueError(f"{prefix} has a bias in the model but none in the checkpoint")
            layer = W4A16Linear(qweight, None if bias is None else to_device(bias))
            _set_module(model, prefix, layer)
        dense = {name: handle for name, handle in where.items() if name not in consumed}
        _load_dense(model, dense, tuple(f"{prefix}." for prefix in prefixes), to_device, dtype)
    # Buffers the model computed itself (rotary frequencies) are not in the checkpoint: they follow too.
    model.to(device)
    return fuse_projections(model) if fuse else model


def _load_dense(model: nn.Module, where: dict, quantized: tuple[str, ...], to_device: _HostToDevice,
                dtype: Optional[torch.dtype]) -> None:
    """Every remaining checkpoint tensor into the model's parameter or buffer of the same name; then a
    check that every other tensor of the model was loaded, is tied to a loaded one, or is a quantized
    layer's (prefixes in `quantized`): a model built on the CPU would otherwise keep random weights."""
    # Every name, tied ones included: a checkpoint may store a tied lm_head beside the embedding.
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    unexpected = sorted(name for name in where if name not in targets)
    if unexpected:
        raise ValueError(f"the checkpoint has tensors the model does not: {_listed(unexpected)} "
                         f"(was the model built from this checkpoint's config?)")
    state = {}
    for name, handle in where.items():
        tensor = handle.get_tensor(name)
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"{name}: the checkpoint's tensor is {tuple(tensor.shape)}, the model's "
                             f"{tuple(target.shape)}")
        if tensor.is_floating_point():
            tensor = tensor.to(dtype or target.dtype)
        state[name] = to_device(tensor)
    # assign=True puts the loaded tensors in place of meta parameters (copying into them would fail).
    model.load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # transformers: a tied lm_head (not stored) points at the loaded embedding again
    current = model.state_dict(keep_vars=True)
    loaded = {current[name].untyped_storage().data_ptr() for name in state if not current[name].is_meta}
    missing = [name for name, t in current.items()
               if name not in state and not name.startswith(quantized)
               and (t.is_meta or t.untyped_storage().data_ptr() not in loaded)]
    if missing:
        raise ValueError(f"the checkpoint has no tensor for {_listed(missing)}")
    meta_buffers = [name for name, t in model.named_buffers() if t.is_meta]
    if meta_buffers:
        raise ValueError(f"buffers {_listed(meta_buffers)} are on the meta device and not in the checkpoint: "
                         f"build the model with only its parameters on meta (as from_pretrained does)")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def from_pretrained(folder, *, dtype: torch.dtype = torch.float16, device="cpu", model_class=None,
                    fuse: bool = False) -> nn.Module:
    """Build the transformers model of a quantized checkpoint folder and load it with `load_checkpoint`.

    `model_class` is a transformers auto class or model class with ``from_config`` (by default
    ``AutoModelForCausalLM``). The model is built from the folder's config.json with its parameters on
    the meta device, so nothing is allocated before the checkpoint's tensors are read. Returns the model
    in eval mode. `fuse` as in `load_checkpoint`.
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path (str or os.PathLike), got {type(folder).__name__}")
    if dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
    import transformers

    folder = os.fspath(folder)
    read_scheme(folder)  # refuse an unsupported checkpoint before building anything
    config = transformers.AutoConfig.from_pretrained(folder)
    # transformers would hand a quantization_config to its own GPTQ / AWQ / compressed-tensors quantizer,
    # which needs optional CUDA packages; this loader reads the tensors itself.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model_class = transformers.AutoModelForCausalLM if model_class is None else model_class
    if not hasattr(model_class, "from_config"):
        raise TypeError(f"model_class must have from_config (a transformers model class), got {model_class!r}")
    try:
        from accelerate import init_empty_weights
    except ImportError as exc:
        raise ImportError("w4a16.from_pretrained builds the model with accelerate.init_empty_weights: "
                          "pip install accelerate (or build the model yourself and call load_checkpoint)") from exc
    # Parameters on the meta device (nothing allocated before the checkpoint is read); buffers stay real, so
    # computed ones (rotary frequencies) keep their values.
    with init_empty_weights(include_buffers=False):
        model = model_class.from_config(config, dtype=dtype)
    return load_checkpoint(model, folder, device=device, dtype=dtype, fuse=fuse).eval()


def load_gguf(model: nn.Module, path, *, dtype: torch.dtype = torch.float16, fuse: bool = False) -> dict[str, int]:
    """Put the 4-bit tensors of the GGUF file at `path` under `model`'s linear layers, in place: every
    ``nn.Linear`` whose tensor is Q4_0, Q4_1 or Q4_K becomes a `W4A16Linear` holding the file's own codes, scales
    and minima (`importers.from_gguf`, scales and minima in `dtype`); the rest (Q6_K, Q8_0, float tensors, 4-bit
    embeddings, which are not linear layers) stays as transformers dequantized it. Returns how many linear layers
    each GGUF tensor type gave ({"Q4_K": 150, "Q6_K (left dequantized)": 30, ...}).

    `model` is the transformers model of that file, loaded (``AutoModelForCausalLM.from_pretrained(folder,
    gguf_file=...)``, any dtype). Tensor names come from gguf's name map of the file's architecture and row orders
    from transformers' tensor processor for it, as transformers' GGUF loader uses them (Llama's q / k rows, for
    one, are permuted back), and every imported weight is checked against the model's dequantized one, so a
    mismatch is refused, never loaded. With `fuse`, q / k / v
    and gate / up then run as one matmul each (`fuse_projections`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a path (str or os.PathLike), got {type(path).__name__}")
    if not isinstance(fuse, bool):
        raise TypeError(f"fuse must be a bool, got {type(fuse).__name__}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype!r}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        import numpy as np
        from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field
    except ImportError as exc:
        raise ImportError("w4a16.load_gguf reads GGUF files with gguf and transformers' GGUF tensor processors: "
                          "pip install gguf transformers") from exc
    reader = GGUFReader(path)
    architecture = read_field(reader, "general.architecture")[0]
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ValueError(f"{path}: the installed gguf package does not know the architecture {architecture!r}")
    config = model.config.to_dict() if hasattr(model, "config") else {}
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    # GGUF tensor name -> the model's linear layer, by gguf's own name map of the file's architecture (what
    # transformers' get_gguf_hf_weights_map builds, once instead of once per submodule)
    name_map = get_tensor_name_map(arch, config.get("num_hidden_layers", 0))
    modules = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            parts = processor.preprocess_name(name).split(".")
            gguf_name = next((found for i in range(len(parts))
                              if (found := name_map.get_name(".".join(parts[i:]))) is not None), None)
            if gguf_name is not None:
                modules[f"{gguf_name}.weight"] = (name, module)
    names = {gguf_name: f"{name}.weight" for gguf_name, (name, _) in modules.items()}
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        if tensor.name not in modules:
            continue
        module_name, linear = modules[tensor.name]
        kind = tensor.tensor_type.name
        if kind not in GGUF_BLOCKS:
            counts[f"{kind} (left dequantized)"] = counts.get(f"{kind} (left dequantized)", 0) + 1
            continue
        if linear.weight.is_meta:
            raise ValueError(f"{module_name}: the model's weights are on the meta device; load the model from the "
                             "GGUF file with transformers first (from_pretrained(..., gguf_file=...))")
        n, k = linear.out_features, linear.in_features
        if tuple(int(d) for d in reversed(tensor.shape)) != (n, k):
            raise ValueError(f"{module_name}: the GGUF tensor {tensor.name} is {tuple(reversed(tensor.shape))} "
                             f"(out, in), the model's nn.Linear {(n, k)}")
        # The processor's row order, read off by running it on the row indices (it permutes rows, or nothing).
        rows = processor.process(weights=np.arange(n, dtype=np.float64)[:, None], name=tensor.name,
                                 tensor_key_mapping=names, parsed_parameters={"config": config, "tensors": {}}).weights
        order = torch.from_numpy(np.asarray(rows, dtype=np.float64).reshape(-1)).long()
        if order.numel() != n or not torch.equal(order.sort().values, torch.arange(n)):
            raise ValueError(f"{module_name}: transformers' GGUF processor for {architecture!r} changes "
                             f"{tensor.name} beyond a row order, which load_gguf cannot follow")
        exact = from_gguf(tensor.data, tensor.tensor_type, (n, k), dtype=torch.float32)
        if not torch.equal(order, torch.arange(n)):
            exact = take_rows(exact, order)
        _check_gguf_weight(module_name, dequantize(exact, torch.float32), linear.weight.detach())
        qweight = replace(exact, scales=exact.scales.to(dtype), dtype=dtype,
                          mins=None if exact.mins is None else exact.mins.to(dtype))
        device = linear.weight.device
        _set_module(model, module_name, W4A16Linear(qweight.to(device), linear.bias))
        counts[kind] = counts.get(kind, 0) + 1
    if fuse:
        fuse_projections(model)
    return counts


def _check_gguf_weight(name: str, exact: torch.Tensor, loaded: torch.Tensor) -> None:
    """The file's weight (dequantized in float32) against the model's, which transformers dequantized and cast to
    its dtype: equal up to that cast's rounding, plus a few float32 ulps of the row's largest value for the order
    of operations. A wrong name or row order misses by the size of the weights."""
    rounding = torch.finfo(loaded.dtype).eps if loaded.is_floating_point() else 0.0
    loaded = loaded.to(exact.device, torch.float32)
    bound = rounding * exact.abs() + 4 * torch.finfo(torch.float32).eps * exact.abs().amax(dim=1, keepdim=True)
    if not bool(((loaded - exact).abs() <= bound).all()):
        worst = ((loaded - exact).abs() / exact.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)).max().item()
        raise ValueError(f"{name}: the GGUF file's weight does not match the model's (largest difference {worst:.3g} "
                         "of its row's largest value): was the model loaded from this file?")
