"""What a checkpoint folder's ``quantization_config`` must say for the 4-bit loaders to read its tensors exactly:
the checks w4a16's and moe-dispatch's checkpoint loaders share. Each standalone package carries this module byte
for byte (tests/test_moe_dispatch_quantized.py checks that they agree)."""

from __future__ import annotations

import json
import os


def require(condition: bool, field: str, value, supported: str) -> None:
    """A ValueError naming the config field unless `condition` holds."""
    if not condition:
        raise ValueError(f"quantization_config.{field} = {value!r} is not supported: {supported}")


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def quantization_config(folder: str) -> tuple[dict, str]:
    """(config.json's ``quantization_config``, its method); else quantize_config.json (AutoGPTQ, GPTQModel)
    or quant_config.json (AutoAWQ), which older tools write beside a config.json without one and which
    may not name their method (``quant_method``), so the file's name does."""
    config_path = os.path.join(folder, "config.json")
    if os.path.isfile(config_path):
        qc = read_json(config_path).get("quantization_config")
        if qc is not None:
            require("quant_method" in qc, "quant_method", None, "config.json's quantization_config must name it")
            return qc, str(qc["quant_method"]).lower()
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            qc = read_json(path)
            return qc, str(qc.get("quant_method", method)).lower()
    raise ValueError(f"{folder} has no quantization_config in config.json and no quantize_config.json or "
                     f"quant_config.json: not a quantized checkpoint folder")


def check_compressed_tensors(qc: dict) -> None:
    """compressed-tensors as llm-compressor saves it: ``pack-quantized`` 4-bit integer weights in group or channel
    scales, saved compressed, static; no activation or KV-cache quantization, sparsity or transforms."""
    fmt = qc.get("format")
    require(fmt == "pack-quantized", "format", fmt, "only compressed-tensors 'pack-quantized' int4")
    status = qc.get("quantization_status")
    require(status == "compressed", "quantization_status", status, "the weights must be saved compressed")
    for field in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        require(not qc.get(field), field, qc.get(field), "only weight quantization is read")
    groups = qc.get("config_groups") or {}
    require(bool(groups), "config_groups", groups, "at least one quantization scheme is needed")
    for name, group in groups.items():
        where = f"config_groups.{name}"
        group_format = group.get("format") or fmt
        require(group_format == "pack-quantized", f"{where}.format", group_format,
                "only compressed-tensors 'pack-quantized' int4")
        for acts in ("input_activations", "output_activations"):
            require(group.get(acts) is None, f"{where}.{acts}", group.get(acts),
                    "4-bit weights with 16-bit activations only")
        weights = group.get("weights") or {}
        checks = (("num_bits", weights.get("num_bits") == 4, "4-bit weights only"),
                  ("type", weights.get("type") == "int", "integer weights only"),
                  ("strategy", weights.get("strategy") in ("group", "channel"), "group or channel scales only"),
                  ("dynamic", not weights.get("dynamic"), "static (stored) scales only"))
        for field, ok, supported in checks:
            require(ok, f"{where}.weights.{field}", weights.get(field), supported)


def awq_symmetric(qc: dict) -> bool:
    """AWQ ``gemm`` tensors as AutoAWQ, transformers and GPTQModel save them, 4 bits; whether they are symmetric
    (``zero_point: false``, GPTQModel's default, still stores qzeros, all 8: the loaders check and drop them)."""
    bits = qc.get("bits", qc.get("w_bit"))
    require(bits == 4, "bits", bits, "4-bit weights only")
    # AutoAWQ and transformers write "version", GPTQModel "format": the tensor layout.
    for key in ("version", "format"):
        layout = str(qc.get(key, "gemm")).lower()
        require(layout == "gemm", key, layout,
                "only AWQ 'gemm' tensors; gemv, gemv_fast, exllama, marlin and ipex layouts are not read")
    zero_point = qc.get("zero_point", True)
    require(isinstance(zero_point, bool), "zero_point", zero_point, "zero_point must be true or false")
    return not zero_point
