"""Load a quantized checkpoint's MoE experts (GPTQ, AWQ, compressed-tensors) into moe-dispatch's 4-bit experts
(`QuantizedExperts`).

`load_quantized_experts(model, folder)` takes a transformers MoE model built from the checkpoint's config
(Mixtral, Qwen3-MoE and other models whose routed experts are one ``*Experts`` module with
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; parameters on the meta device or anywhere) and the
checkpoint folder, reads every expert's tensors, converts them exactly (the checkpoint's own codes,
scales and zero points, only re-laid out: nothing is rounded again) and puts them in place of the module's
``gate_up_proj`` / ``down_proj`` as `quantize_experts_module` does. The experts then run in moe-dispatch's
4-bit kernels through `experts_forward` (``ExpertsInterface`` or ``kernels.kernelize``). The names of the
checkpoint tensors it read are returned: everything else (attention, router, norms, embeddings) is left
for the caller to load; moe-dispatch handles the routed experts only.

Supported, per expert e and projection (``gate_proj`` / ``up_proj`` / ``down_proj``, transformers 5 and the
tools' names, or Mixtral's ``w1`` / ``w3`` / ``w2``; under the model's experts module or, for Mixtral
checkpoints of older transformers, under ``block_sparse_moe.experts``), one safetensors file or an index of
shards:
- GPTQ as GPTQModel and AutoGPTQ write it (``quant_method: gptq``; ``quantization_config`` in config.json or a
  quantize_config.json), 4 bits, int32 packing, tensor layout ``gptq`` (v1: zero points stored minus 1) or
  ``gptq_v2``, symmetric (every zero point 8, dropped) or with zero points: ``<experts>.<e>.<proj>.{qweight,
  qzeros, scales, g_idx}``, qweight int32 ``[K/8, N]`` packed along K (nibble i of word r is row 8r + i), qzeros
  int32 ``[G, N/8]`` packed along N, scales ``[G, N]``, g_idx ``[K]``.
- AWQ ``gemm`` as AutoAWQ and GPTQModel write it (``quant_method: awq``, or a quant_config.json), 4 bits,
  ``zero_point`` true, or false (every stored zero point 8, dropped): ``<experts>.<e>.<proj>.{qweight, qzeros,
  scales}``, qweight int32 ``[K, N/8]`` and qzeros int32 ``[G, N/8]`` packed along N in AWQ's nibble order
  (re-packed along K here, exactly), scales ``[G, N]``.
- compressed-tensors ``pack-quantized`` as llm-compressor writes it (``quant_method: compressed-tensors``,
  saved compressed), 4-bit integer weights in groups or per channel, symmetric or with zero points:
  ``<experts>.<e>.<proj>.{weight_packed, weight_scale, weight_shape, weight_zero_point, weight_g_idx}``,
  weight_packed int32 ``[N, K/8]`` packed along K (the signed code plus 8), weight_scale ``[N, G]``,
  weight_zero_point int32 ``[N/8, G]`` packed along N.
Group sizes 32, 64, a multiple of 128 or per channel.

Refused with a ValueError naming the config field or the tensor, never approximated: other methods and
bit widths (3-bit, 8-bit), kernel-specific layouts (marlin, exllama, bitblas, AWQ gemv), other pack dtypes, quantized
activations, act-order checkpoints whose group index is not the natural ``k // group_size`` (``desc_act``
without ``static_groups``, compressed-tensors' ``actorder: group``: the fused kernels read one shared
activation row for every expert, and this format has no per-expert column permutation), group sizes the
kernels do not take, gate and up projections of one expert with different group sizes, experts of one module
with and without zero points, zero points the format cannot hold (GPTQ v1's stored 15, i.e. 16), expert
biases, missing or extra experts, and shapes that do not match the model.
"""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager
from typing import Optional

import torch
from torch import nn

from .layers import _unsupported
from .quant_config import awq_symmetric, check_compressed_tensors, quantization_config, read_json, require
from .quantized import FLOAT_DTYPES, QuantizedExperts, check_group_size, pack_k_words, pad_group_params

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# (gate, up, down) projection names per naming scheme: transformers 5 / GPTQModel, Mixtral's original.
_PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# The tensors of one projection per method: (required, optional); the first names the quantized experts.
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ packs column 8c + j of a word into nibble AWQ_UNPACK_ORDER[j]
_PARTS = {"gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
          "awq": (("qweight", "qzeros", "scales"), ()),
          "compressed-tensors": (("weight_packed", "weight_scale", "weight_shape"),
                                 ("weight_zero_point", "weight_g_idx"))}


def read_quant_config(folder) -> dict:
    """The folder's quantization settings: ``{"method": "gptq", "sym": bool, "checkpoint_format": "gptq" |
    "gptq_v2"}``, ``{"method": "awq", "sym": bool}`` or ``{"method": "compressed-tensors"}``; a ValueError
    naming the config field for anything `load_quantized_experts` does not read exactly."""
    qc, method = quantization_config(os.fspath(folder))
    readers = {"gptq": _gptq_settings, "awq": lambda qc: {"sym": awq_symmetric(qc)},
               "compressed-tensors": _compressed_tensors_settings}
    require(method in readers, "quant_method", qc.get("quant_method", method),
            f"the methods read are {', '.join(readers)}")
    return {"method": method, **readers[method](qc)}


def _gptq_settings(qc: dict) -> dict:
    bits = qc.get("bits")
    require(bits == 4, "bits", bits, "moe-dispatch holds 4-bit experts only")
    formats = {key: qc[key] for key in ("checkpoint_format", "format") if key in qc}
    for key, value in formats.items():
        require(value in ("gptq", "gptq_v2"), key, value,
                 "only the 'gptq' (v1) and 'gptq_v2' tensor layouts; marlin, bitblas, exllama-repacked and other "
                 "kernel-specific layouts are not read")
    require(len(set(formats.values())) <= 1, "format", formats, "checkpoint_format and format must agree")
    pack_dtype = qc.get("pack_dtype", "int32")
    require(pack_dtype == "int32", "pack_dtype", pack_dtype, "qweight / qzeros must be packed in int32")
    require(not qc.get("is_marlin_format"), "is_marlin_format", qc.get("is_marlin_format"),
             "marlin-repacked tensors are not read")
    sym = qc.get("sym", True)
    require(isinstance(sym, bool), "sym", sym, "sym must be true or false")
    # GPTQModel's per-module overrides: "-:" patterns leave modules unquantized (their experts then have no
    # qweight and are refused below); other bits or another sym would change how the tensors decode.
    for pattern, override in (qc.get("dynamic") or {}).items():
        if pattern.startswith("-:") or not isinstance(override, dict):
            continue
        for field, expected in (("bits", 4), ("sym", sym)):
            value = override.get(field, expected)
            require(value == expected, f"dynamic[{pattern!r}].{field}", value,
                     f"per-module overrides must keep {field} = {expected!r}")
    require(qc.get("model_file_base_name") is None, "model_file_base_name", qc.get("model_file_base_name"),
             f"weights must be in {_SINGLE} or shards listed in {_INDEX}")
    return {"sym": sym, "checkpoint_format": next(iter(formats.values()), "gptq")}


def _compressed_tensors_settings(qc: dict) -> dict:
    check_compressed_tensors(qc)
    return {}


def _shard_files(folder: str) -> list[str]:
    index = os.path.join(folder, _INDEX)
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        return [os.path.join(folder, f) for f in sorted(set(weight_map.values()))]
    if os.path.isfile(os.path.join(folder, _SINGLE)):
        return [os.path.join(folder, _SINGLE)]
    raise ValueError(f"{folder} has no {_SINGLE} and no {_INDEX} (only safetensors checkpoints are read)")


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


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: nibble i of each word at index i. From the words' bytes (little-endian:
    byte b holds nibbles 2b and 2b + 1), so no 32-bit intermediate per nibble."""
    word_bytes = packed.contiguous().view(torch.uint8).view(*packed.shape, 4)
    return torch.stack((word_bytes & 0xF, word_bytes >> 4), dim=-1).view(*packed.shape, 8)


def _check(name: str, t: torch.Tensor, dtypes, shape: tuple) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} for the model's experts, got {tuple(t.shape)}")


def _group_size(name: str, groups: int, k: int) -> int:
    """The group size of `groups` scale groups over K (-1: one group, per channel), refused by `name` unless the
    kernels take it."""
    if groups <= 0 or k % groups:
        raise ValueError(f"{name} has {groups} groups, which do not divide K = {k}")
    group_size = -1 if groups == 1 else k // groups
    try:
        check_group_size(group_size, k)
    except ValueError as error:
        raise ValueError(f"{name}: group size {group_size} (K = {k} over {groups} groups) is not one the 4-bit "
                         f"kernels take: {error}") from None
    return group_size


def _scale_groups(name: str, scales: torch.Tensor, n: int, k: int, n_dim: int) -> tuple[int, int]:
    """(groups, group size) of a projection's 2-D float scales whose dimension `n_dim` holds the N rows and the
    other the groups; refused by `name` otherwise."""
    if scales.dtype not in FLOAT_DTYPES or scales.dim() != 2 or scales.shape[n_dim] != n:
        shape = f"[groups, {n}]" if n_dim == 1 else f"[{n}, groups]"
        raise ValueError(f"{name} must be a float tensor of shape {shape}, got {scales.dtype} {tuple(scales.shape)}")
    groups = scales.shape[1 - n_dim]
    return groups, _group_size(name, groups, k)


def _check_natural_order(name: str, g_idx: Optional[torch.Tensor], k: int, group_size: int) -> None:
    """A stored group index must be the natural ``k // group_size``: act order permutes columns per expert."""
    if g_idx is None:
        return
    _check(name, g_idx, (torch.int32, torch.int64), (k,))
    natural = torch.arange(k, device=g_idx.device) // (k if group_size == -1 else group_size)
    if not torch.equal(g_idx.long(), natural):
        raise ValueError(f"{name} is an act-order group index, not the natural k // "
                         f"{group_size if group_size != -1 else k}: moe-dispatch's experts share one activation row "
                         f"and cannot permute input columns per expert")


def _decode_gptq(prefix: str, parts: dict, n: int, k: int, sym: bool, checkpoint_format: str):
    """One GPTQ projection [N, K] -> (qweight words int32 [K / 8, N] as stored, scales [G, N], zeros uint8
    [G, N] or None, group_size)."""
    qweight, qzeros, scales, g_idx = (parts.get(p) for p in ("qweight", "qzeros", "scales", "g_idx"))
    _check(f"{prefix}.qweight", qweight, (torch.int32,), (k // 8, n))
    groups, group_size = _scale_groups(f"{prefix}.scales", scales, n, k, n_dim=1)
    _check(f"{prefix}.qzeros", qzeros, (torch.int32,), (groups, -(-n // 8)))
    _check_natural_order(f"{prefix}.g_idx", g_idx, k, group_size)
    zeros = _nibbles(qzeros).flatten(-2)[:, :n]  # [G, N]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    if sym:
        if not bool((zeros == 8).all()):
            found = sorted(set(zeros.unique().tolist()))[:4]
            raise ValueError(f"{prefix}.qzeros: sym=True expects every zero point to be 8, got values {found} with "
                             f"checkpoint_format={checkpoint_format!r} (v1 'gptq' stores 7, 'gptq_v2' stores 8)")
        return qweight, scales, None, group_size
    if bool((zeros > 15).any()):
        raise ValueError(f"{prefix}.qzeros holds a stored 15 in a v1 ('gptq') checkpoint: v1 stores zero - 1, so "
                         f"that is zero point 16, which a 4-bit zero point cannot hold (GPTQModel's own v1 -> v2 "
                         f"conversion wraps it to 0 and carries into the next column): ambiguous, not read")
    return qweight, scales, zeros.to(torch.uint8), group_size


def _decode_awq(prefix: str, parts: dict, n: int, k: int, sym: bool):
    """One AWQ ``gemm`` projection [N, K] -> (words int32 [K / 8, N] packed along K as GPTQ's, scales [G, N], zeros
    uint8 [G, N] or None, group_size). AWQ packs along N, in its own nibble order: the codes are unpacked and
    packed again along K, exactly."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if n % 8 or k % 8:
        raise ValueError(f"{prefix}: AWQ experts need N and K that are multiples of 8, got N = {n}, K = {k}")
    _check(f"{prefix}.qweight", qweight, (torch.int32,), (k, n // 8))
    groups, group_size = _scale_groups(f"{prefix}.scales", scales, n, k, n_dim=1)
    _check(f"{prefix}.qzeros", qzeros, (torch.int32,), (groups, n // 8))
    order = torch.tensor(AWQ_UNPACK_ORDER, device=qweight.device)
    codes = _nibbles(qweight)[..., order].reshape(k, n)
    zeros = _nibbles(qzeros)[..., order].reshape(groups, n)
    # nibble i of word r holds row 8r + i: byte b of a word holds rows 8r + 2b (low) and 8r + 2b + 1 (high)
    pairs = codes.view(k // 8, 4, 2, n)
    words = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).permute(0, 2, 1).contiguous().view(torch.int32)
    if sym:
        if not bool((zeros == 8).all()):
            found = sorted(set(zeros.unique().tolist()))[:4]
            raise ValueError(f"{prefix}.qzeros: zero_point false expects every zero point to be 8, got values {found}")
        zeros = None
    return words.view(k // 8, n), scales, zeros, group_size


def _decode_compressed_tensors(prefix: str, parts: dict, n: int, k: int):
    """One compressed-tensors pack-quantized projection [N, K] -> (words int32 [K / 8, N], scales [G, N], zeros
    uint8 [G, N] or None, group_size). Codes are the signed values plus 8, so symmetric weights are exactly the
    implicit zero point 8, and a stored zero point (signed plus 8) pairs with the stored codes as it is."""
    packed, scale, shape = parts["weight_packed"], parts["weight_scale"], parts["weight_shape"]
    if shape.numel() != 2 or tuple(int(v) for v in shape.tolist()) != (n, k):
        raise ValueError(f"{prefix}.weight_shape must be {[n, k]} for the model's experts, got {shape.tolist()}")
    _check(f"{prefix}.weight_packed", packed, (torch.int32,), (n, k // 8))
    groups, group_size = _scale_groups(f"{prefix}.weight_scale", scale, n, k, n_dim=0)
    _check_natural_order(f"{prefix}.weight_g_idx", parts.get("weight_g_idx"), k, group_size)
    zeros = parts.get("weight_zero_point")
    if zeros is not None:
        _check(f"{prefix}.weight_zero_point", zeros, (torch.int32,), (-(-n // 8), groups))
        zeros = _nibbles(zeros.t()).flatten(-2)[:, :n].to(torch.uint8)  # [G, N]
    return packed.t(), scale.t(), zeros, group_size


def _is_experts_module(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, name, None), torch.Tensor) for name in ("gate_up_proj", "down_proj"))


def _checkpoint_prefixes(name: str) -> list[str]:
    """Where a checkpoint may keep the experts of the model's module `name`."""
    prefixes = [name]
    if ".mlp.experts" in name:  # Mixtral saved by transformers 4 (MixtralSparseMoeBlock)
        prefixes.append(name.replace(".mlp.experts", ".block_sparse_moe.experts"))
    return prefixes


def load_quantized_experts(model: nn.Module, folder, *, device=None) -> list[str]:
    """Put the quantized checkpoint's experts in `folder` (GPTQ, AWQ or compressed-tensors) into `model`'s experts
    modules, in place.

    Every ``*Experts`` module of `model` (``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, e.g.
    ``model.layers.<i>.mlp.experts`` of Mixtral / Qwen3-MoE) gets `QuantizedExperts` as gate_up_proj (each
    expert's gate_proj rows, then its up_proj rows) and down_proj, on `device` (default: the CPU), built
    exactly from the checkpoint's codes, scales and zero points (see the module docstring for what is read
    and what is refused). Run the model with moe-dispatch's experts forward afterwards::

        from transformers.integrations.moe import ExpertsInterface
        ExpertsInterface.register("moe_dispatch", moe_dispatch.experts_forward)
        model.set_experts_implementation("moe_dispatch")

    Returns the sorted names of the checkpoint tensors read: the caller loads the rest (attention, router,
    norms, embeddings) into the model its own way.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path (str or os.PathLike), got {type(folder).__name__}")
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be None, a torch.device or a device string, got {type(device).__name__}")
    device = torch.device("cpu" if device is None else device)
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    settings = read_quant_config(folder)
    marker = _PARTS[settings["method"]][0][0]
    modules = [(name, m) for name, m in model.named_modules() if _is_experts_module(m)]
    if not modules:
        raise ValueError(f"model: {type(model).__name__} has no experts module with gate_up_proj [E, 2I, H] and "
                         f"down_proj [E, H, I] tensors (is it a transformers 5 MoE model?)")
    consumed: set[str] = set()
    with _open_shards(_shard_files(folder)) as where:
        expert_keys = {key for key in where if key.endswith(f".{marker}") and ".experts." in key}
        if not expert_keys:
            raise ValueError(f"{folder} stores no quantized experts (no '*.experts.<e>.<proj>.{marker}' tensors)")
        converted = []
        for name, module in modules:
            converted.append((module, _load_module(name, module, where, settings, consumed, device)))
        unexpected = sorted(expert_keys - consumed)
        if unexpected:
            listed = ", ".join(unexpected[:3]) + (f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else "")
            raise ValueError(f"the checkpoint has quantized expert tensors the model has no experts for: {listed} "
                             f"(was the model built from this checkpoint's config?)")
    for module, (gate_up, down) in converted:  # only once every module converted: no half-loaded model
        for attr, value in (("gate_up_proj", gate_up), ("down_proj", down)):
            delattr(module, attr)
            setattr(module, attr, value)
        reason = _unsupported(module)
        if reason is not None:
            raise ValueError(f"model: moe-dispatch cannot run {type(module).__name__}: {reason}")
    return sorted(consumed)


def _load_module(name: str, module: nn.Module, where: dict, settings: dict, consumed: set,
                 device: torch.device) -> tuple[QuantizedExperts, QuantizedExperts]:
    experts, two_i, hidden = module.gate_up_proj.shape
    intermediate = two_i // 2
    if tuple(module.down_proj.shape) != (experts, hidden, intermediate):
        raise ValueError(f"model: {name}.down_proj is {tuple(module.down_proj.shape)}, expected "
                         f"{(experts, hidden, intermediate)} for gate_up_proj {tuple(module.gate_up_proj.shape)}")
    required, optional = _PARTS[settings["method"]]
    marker = required[0]
    prefix = projections = None
    for candidate in _checkpoint_prefixes(name):
        for names in _PROJECTIONS:
            if f"{candidate}.0.{names[0]}.{marker}" in where:
                prefix, projections = candidate, names
                break
        if prefix is not None:
            break
    if prefix is None:
        raise ValueError(f"the checkpoint has no {name}.0.gate_proj.{marker} (nor w1, nor under "
                         f"block_sparse_moe): the experts of {name} are not quantized in it")
    if f"{prefix}.{experts}.{projections[0]}.{marker}" in where:
        raise ValueError(f"the checkpoint has {prefix}.{experts}.{projections[0]}.{marker} but the model's {name} "
                         f"has {experts} experts")
    sizes = {projections[0]: (intermediate, hidden), projections[1]: (intermediate, hidden),
             projections[2]: (hidden, intermediate)}
    decoded: dict[str, list] = {proj: [] for proj in projections}
    for e in range(experts):
        for proj in projections:
            key = f"{prefix}.{e}.{proj}"
            parts = {}
            for part in required + optional:
                if f"{key}.{part}" in where:
                    parts[part] = where[f"{key}.{part}"].get_tensor(f"{key}.{part}").to(device)
                    consumed.add(f"{key}.{part}")
                elif part in required:
                    raise ValueError(f"the checkpoint has no {key}.{part} ({settings['method']} experts need "
                                     f"{', '.join(required)} for every expert's {', '.join(projections)})")
            if f"{key}.bias" in where:
                raise ValueError(f"{key}.bias: experts with bias are not supported (the kernels compute "
                                 f"SiLU(gate) * up experts without bias)")
            n, k = sizes[proj]
            if settings["method"] == "gptq":
                decoded[proj].append(_decode_gptq(key, parts, n, k, settings["sym"], settings["checkpoint_format"]))
            elif settings["method"] == "awq":
                decoded[proj].append(_decode_awq(key, parts, n, k, settings["sym"]))
            else:
                decoded[proj].append(_decode_compressed_tensors(key, parts, n, k))
    gate, up, down = (decoded[p] for p in projections)
    if len({r[2] is None for rows in (gate, up, down) for r in rows}) > 1:
        raise ValueError(f"{prefix}: some experts' projections have zero points and others not; one module's "
                         f"QuantizedExperts are all symmetric or all with zero points")
    for e in range(experts):
        if gate[e][3] != up[e][3]:
            raise ValueError(f"{prefix}.{e}.{projections[1]}.scales: group size {up[e][3]} differs from "
                             f"{projections[0]}'s {gate[e][3]}; gate and up run as one [2I, H] matrix with one group size")
    for proj, rows in zip(projections, (gate, up, down)):
        sizes_seen = {r[3] for r in rows}
        if len(sizes_seen) > 1:
            raise ValueError(f"{prefix}.<e>.{proj}.scales: experts have different group sizes {sorted(sizes_seen)}; "
                             f"one QuantizedExperts holds one group size")
    dtypes = {r[1].dtype for rows in (gate, up, down) for r in rows}
    if len(dtypes) > 1:
        raise ValueError(f"{prefix}.<e>.<proj>.scales: experts store scales in several dtypes {sorted(map(str, dtypes))}")

    def stacked(rows_a: list, rows_b: Optional[list], n: int, k: int) -> QuantizedExperts:
        def cat(i: int) -> Optional[torch.Tensor]:
            if rows_a[0][i] is None:
                return None
            # words [K / 8, N], scales / zeros [G, N]: gate and up rows joined along N
            per_expert = [a[i] if rows_b is None else torch.cat([a[i], b[i]], 1) for a, b in
                          zip(rows_a, rows_b or rows_a)]
            return torch.stack(per_expert)

        group_size = rows_a[0][3]
        words, scales, zeros = cat(0), cat(1), cat(2)
        return QuantizedExperts(qweight=pack_k_words(words, (n, k)),
                                scales=pad_group_params(scales, (n, k), group_size),
                                shape=(n, k), group_size=group_size, fmt="int4",
                                zeros=None if zeros is None else pad_group_params(zeros, (n, k), group_size),
                                dtype=scales.dtype)

    return stacked(gate, up, two_i, hidden), stacked(down, None, hidden, intermediate)
