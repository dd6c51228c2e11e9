"""What a checkpoint folder's ``quantization_config`` must say for the 4-bit loaders to read its tensors exactly:
the checks w4a16's and moe-dispatch's checkpoint loaders share. Each standalone package carries this module byte
for byte (tests/test_moe_dispatch_quantized.py checks that they agree)."""

from __future__ import annotations


def require(condition: bool, field: str, value, supported: str) -> None:
    """A ValueError naming the config field unless `condition` holds."""
    if not condition:
        raise ValueError(f"quantization_config.{field} = {value!r} is not supported: {supported}")


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
