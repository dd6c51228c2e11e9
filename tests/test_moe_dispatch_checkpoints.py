"""moe-dispatch's experts importer against checkpoints made by GPTQModel and llm-compressor themselves (CPU).

The fixtures (tests/fixtures/moe_dispatch/, made by tests/fixtures/moe_dispatch/maker.py through
scripts/make_fixtures.py moe-dispatch) are a tiny random Mixtral and a tiny random Qwen3-MoE quantized by each
tool from random-token calibration (GPTQ, compressed-tensors pack-quantized), with the logits of the tool's own
CPU inference. Here `load_quantized_experts` puts the experts into moe-dispatch's 4-bit format and they run
in its kernels (Triton through the interpreter, and the PyTorch path); attention, whose quantized linears
moe-dispatch does not take, is dequantized with the plain formulas in this file ((q - zero) * scale), and
everything else is loaded as stored. Every parameter of the model is NaN before loading, so anything left
unloaded shows in the logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures" / "moe_dispatch"
TOOL_FIXTURES = [("gptqmodel", "mixtral-gptq-g32-sym"), ("gptqmodel", "qwen3-moe-gptq-g64-asym-actorder-static"),
                 ("gptqmodel", "mixtral-awq-g32-sym"), ("gptqmodel", "qwen3-moe-awq-g64-zp"),
                 ("llmcompressor", "mixtral-llmcompressor-g32-sym"),
                 ("llmcompressor", "qwen3-moe-llmcompressor-g64-asym")]


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("moe-dispatch")


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def build_model(folder: Path):
    """The transformers model of the folder's config, float16, every parameter NaN."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    del config.quantization_config  # transformers' own GPTQ quantizer would want optional CUDA packages
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    return model


def dequantize_gptq(parts: dict, sym: bool, checkpoint_format: str) -> torch.Tensor:
    """A GPTQ linear's float16 weight [N, K]: (q - zero[g_idx]) * scale[g_idx], one rounding to float16."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    codes = ((qweight.unsqueeze(-1) >> shifts) & 0xF).permute(0, 2, 1).reshape(k, n)  # [K, N]
    zeros = ((qzeros.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)[:, :n] + (1 if checkpoint_format == "gptq" else 0)
    g_idx = parts["g_idx"].long()
    weight = (codes - zeros[g_idx]).float() * scales[g_idx].float()
    return weight.t().to(torch.float16)


AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j of an AWQ word is its nibble AWQ_ORDER[j]


def dequantize_awq(parts: dict) -> torch.Tensor:
    """An AWQ gemm linear's float16 weight [N, K]: (q - zero) * scale per group (zeros stored as they are: 8 when
    symmetric), one rounding to float16."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k, n, groups = qweight.shape[0], qweight.shape[1] * 8, scales.shape[0]
    codes = ((qweight.unsqueeze(-1) >> shifts) & 0xF)[..., list(AWQ_ORDER)].reshape(k, n)
    zeros = ((qzeros.unsqueeze(-1) >> shifts) & 0xF)[..., list(AWQ_ORDER)].reshape(groups, n)
    group = k // groups
    weight = (codes - zeros.repeat_interleave(group, 0)).float() * scales.repeat_interleave(group, 0).float()
    return weight.t().to(torch.float16)


def dequantize_compressed_tensors(parts: dict) -> torch.Tensor:
    """A compressed-tensors pack-quantized linear's float16 weight [N, K]: (q - zero) * scale per group, q and
    zero the stored nibbles (signed values plus 8; zero 8 when symmetric), one rounding to float16."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    n, k = parts["weight_shape"].tolist()
    codes = ((parts["weight_packed"].unsqueeze(-1) >> shifts) & 0xF).flatten(-2)[:, :k]  # [N, K]
    scale = parts["weight_scale"]  # [N, G]
    zero = torch.full(scale.shape, 8, dtype=torch.int32)
    if "weight_zero_point" in parts:
        zero = ((parts["weight_zero_point"].t().unsqueeze(-1) >> shifts) & 0xF).flatten(-2)[:, :n].t()
    group = k // scale.shape[1]
    weight = (codes - zero.repeat_interleave(group, 1)).float() * scale.repeat_interleave(group, 1).float()
    return weight.to(torch.float16)


def load(k, folder: Path, model=None):
    """The fixture's model: experts through moe-dispatch, the rest from the checkpoint in plain torch."""
    model = build_model(folder) if model is None else model
    consumed = set(k.load_quantized_experts(model, folder))
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    # Mixtral's router in transformers 4 names (llm-compressor saves them so) is the model's mlp.gate
    tensors = {name.replace(".block_sparse_moe.", ".mlp."): t for name, t in read_tensors(folder).items()
               if name not in consumed}
    state = {}
    if qc["quant_method"] == "gptq":
        for prefix in sorted(name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight")):
            parts = {part: tensors.pop(f"{prefix}.{part}") for part in ("qweight", "qzeros", "scales", "g_idx")}
            state[f"{prefix}.weight"] = dequantize_gptq(parts, qc["sym"], qc["checkpoint_format"])
    elif qc["quant_method"] == "awq":
        for prefix in sorted(name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight")):
            parts = {part: tensors.pop(f"{prefix}.{part}") for part in ("qweight", "qzeros", "scales")}
            state[f"{prefix}.weight"] = dequantize_awq(parts)
    else:
        packed = sorted(name.removesuffix(".weight_packed") for name in tensors if name.endswith(".weight_packed"))
        for prefix in packed:
            parts = {part: tensors.pop(f"{prefix}.{part}") for part in
                     ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
                     if f"{prefix}.{part}" in tensors}
            state[f"{prefix}.weight"] = dequantize_compressed_tensors(parts)
    state.update(tensors)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    # only the experts' weights, which the importer replaced, are not model parameters any more
    assert not missing, missing
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return model


def run_logits(k, model, input_ids, monkeypatch) -> torch.Tensor:
    from transformers.integrations.moe import ExpertsInterface

    calls = []

    def counted(self, *args):
        calls.append(type(self).__name__)
        return k.experts_forward(self, *args)

    monkeypatch.setitem(ExpertsInterface._global_mapping, "moe_dispatch", counted)
    model.set_experts_implementation("moe_dispatch")
    with torch.no_grad():
        logits = model(input_ids).logits
    assert len(calls) == model.config.num_hidden_layers  # every layer's experts ran in moe-dispatch
    return logits


# Tolerance against the tools' logits. Both sides compute with the same float16 weights (the checkpoint's
# codes, zero points and scales: GPTQModel's TorchLinear / AWQ torch kernel and compressed-tensors'
# quantize-dequantize forward make (q - zero) * scale in float16 and matmul; moe-dispatch's kernels dequantize
# the same values in registers, the test's attention the same way in plain torch), so the difference is
# float16 rounding of the activations in a different order (grouped experts, summed in another order, fp32
# accumulators in other places): a few roundings of 2^-11 relative per layer, two layers, ~1e-3 of the logits'
# norm. 1e-2 relative (and 4x that against the max for any element) leaves room for that and is still far
# below what a wrong expert costs (the experts rolled by one, measured below, move the logits by ~0.3-0.5
# relative).
TOL = 1e-2


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("tool,name", TOOL_FIXTURES, ids=[name for _, name in TOOL_FIXTURES])
def test_moe_matches_tool_logits(k, path, monkeypatch, tool, name):
    folder = FIXTURES / tool / name
    reference = json.loads((folder / "reference.json").read_text())
    model = load(k, folder)
    for layer in model.model.layers:
        assert isinstance(layer.mlp.experts.gate_up_proj, k.QuantizedExperts)
        assert isinstance(layer.mlp.experts.down_proj, k.QuantizedExperts)
    settings = reference["settings"]
    group_size, sym = ((settings["group_size"], settings["sym"]) if tool == "gptqmodel" else
                       (settings["weights"]["group_size"], settings["weights"]["symmetric"]))
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj
    assert gate_up.group_size == group_size and (gate_up.zeros is None) == sym
    logits = run_logits(k, model, torch.tensor(reference["input_ids"]), monkeypatch)
    ref = torch.tensor(reference["logits"])
    assert torch.isfinite(logits).all()
    error = relative_error(logits, ref)
    print(f"{name} [{path}]: relative error {error:.2e}")
    assert error <= TOL, f"relative error {error:.2e} > {TOL}"
    assert (logits.double() - ref.double()).abs().max() <= 4 * TOL * ref.abs().max()
    if path == "torch":  # the tolerance tells a wrong expert apart: the experts of layer 0 rolled by one
        experts = model.model.layers[0].mlp.experts
        for attr in ("gate_up_proj", "down_proj"):
            qe = getattr(experts, attr)
            rolled = type(qe)(**{**qe.__dict__, "qweight": qe.qweight.roll(1, 0), "scales": qe.scales.roll(1, 0),
                                 "zeros": None if qe.zeros is None else qe.zeros.roll(1, 0)})
            setattr(experts, attr, rolled)
        wrong = run_logits(k, model, torch.tensor(reference["input_ids"]), monkeypatch)
        print(f"experts rolled: relative error {relative_error(wrong, ref):.2e}")
        assert relative_error(wrong, ref) > 10 * TOL


# ----------------------------------------------------------------------------------------------------
# Exactness, other layouts of the same tensors, and what is refused (no forward needed)
# ----------------------------------------------------------------------------------------------------

MIXTRAL = FIXTURES / "gptqmodel" / "mixtral-gptq-g32-sym"
QWEN3 = FIXTURES / "gptqmodel" / "qwen3-moe-gptq-g64-asym-actorder-static"


def altered(tmp_path: Path, source: Path, tensors=None, quantization=None) -> Path:
    """A copy of the fixture `source` with `tensors(dict)` / `quantization(dict)` applied in place."""
    from safetensors.torch import save_file

    folder = tmp_path / source.name
    shutil.copytree(source, folder)
    if tensors is not None:
        stored = read_tensors(source)
        tensors(stored)
        save_file(stored, folder / "model.safetensors")
    if quantization is not None:
        config = json.loads((folder / "config.json").read_text())
        quantization(config["quantization_config"])
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def experts_of(model) -> list:
    return [(layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj) for layer in model.model.layers]


def assert_same_experts(a, b) -> None:
    for pair_a, pair_b in zip(a, b, strict=True):
        for qa, qb in zip(pair_a, pair_b):
            assert qa.shape == qb.shape and qa.group_size == qb.group_size
            for name, t in qa.tensors().items():
                assert torch.equal(t, qb.tensors()[name]), name


@pytest.mark.parametrize("folder", [MIXTRAL, QWEN3], ids=["mixtral", "qwen3-moe"])
def test_experts_are_exact(k, folder):
    """Every expert dequantizes to exactly the float16 weights of the plain GPTQ formula (no re-rounding):
    gate_up_proj = [gate_proj; up_proj] rows, down_proj = down_proj."""
    model = build_model(folder)
    consumed = k.load_quantized_experts(model, folder)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = read_tensors(folder)
    experts = model.config.num_local_experts if hasattr(model.config, "num_local_experts") else model.config.num_experts
    assert len(consumed) == model.config.num_hidden_layers * experts * 3 * 4  # qweight, qzeros, scales, g_idx
    for i, (gate_up, down) in enumerate(experts_of(model)):
        assert gate_up.scales.dtype == torch.float16 and gate_up.num_experts == experts
        for e in range(experts):
            def plain(proj):
                prefix = f"model.layers.{i}.mlp.experts.{e}.{proj}"
                return dequantize_gptq({p: tensors[f"{prefix}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")},
                                       qc["sym"], qc["checkpoint_format"])

            assert torch.equal(k.dequantize(gate_up, torch.float16)[e],
                               torch.cat([plain("gate_proj"), plain("up_proj")]))
            assert torch.equal(k.dequantize(down, torch.float16)[e], plain("down_proj"))


MIXTRAL_AWQ = FIXTURES / "gptqmodel" / "mixtral-awq-g32-sym"
QWEN3_AWQ = FIXTURES / "gptqmodel" / "qwen3-moe-awq-g64-zp"
MIXTRAL_CT = FIXTURES / "llmcompressor" / "mixtral-llmcompressor-g32-sym"
QWEN3_CT = FIXTURES / "llmcompressor" / "qwen3-moe-llmcompressor-g64-asym"
CT_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


@pytest.mark.parametrize("folder", [MIXTRAL_CT, QWEN3_CT], ids=["mixtral", "qwen3-moe"])
def test_compressed_tensors_experts_are_exact(k, folder):
    """Every expert of an llm-compressor checkpoint dequantizes to exactly the float16 weights of the plain
    compressed-tensors formula (no re-rounding), under the transformers 4 Mixtral names llm-compressor writes
    (block_sparse_moe) or transformers 5's."""
    model = build_model(folder)
    consumed = k.load_quantized_experts(model, folder)
    tensors = read_tensors(folder)
    sym = "weight_zero_point" not in "".join(tensors)
    experts = model.config.num_local_experts if hasattr(model.config, "num_local_experts") else model.config.num_experts
    assert len(consumed) == model.config.num_hidden_layers * experts * 3 * (3 if sym else 4)
    for i, (gate_up, down) in enumerate(experts_of(model)):
        assert (gate_up.zeros is None) == sym and (down.zeros is None) == sym
        for e in range(experts):
            def plain(proj):
                prefix = next(f"model.layers.{i}.{block}.experts.{e}.{proj}" for block in ("mlp", "block_sparse_moe")
                              if f"model.layers.{i}.{block}.experts.{e}.{proj}.weight_packed" in tensors)
                return dequantize_compressed_tensors({p: tensors[f"{prefix}.{p}"] for p in CT_PARTS
                                                      if f"{prefix}.{p}" in tensors})

            assert torch.equal(k.dequantize(gate_up, torch.float16)[e],
                               torch.cat([plain("gate_proj"), plain("up_proj")]))
            assert torch.equal(k.dequantize(down, torch.float16)[e], plain("down_proj"))


@pytest.mark.parametrize("folder", [MIXTRAL_AWQ, QWEN3_AWQ], ids=["mixtral", "qwen3-moe"])
def test_awq_experts_are_exact(k, folder):
    """Every expert of an AWQ checkpoint (GPTQModel's, gemm) dequantizes to exactly the float16 weights of the
    plain AWQ formula: AWQ's nibble order along N, packed again along K, changes no code."""
    model = build_model(folder)
    k.load_quantized_experts(model, folder)
    tensors = read_tensors(folder)
    for i, (gate_up, down) in enumerate(experts_of(model)):
        for e in range(gate_up.num_experts):
            def plain(proj):
                prefix = f"model.layers.{i}.mlp.experts.{e}.{proj}"
                return dequantize_awq({p: tensors[f"{prefix}.{p}"] for p in ("qweight", "qzeros", "scales")})

            assert torch.equal(k.dequantize(gate_up, torch.float16)[e],
                               torch.cat([plain("gate_proj"), plain("up_proj")]))
            assert torch.equal(k.dequantize(down, torch.float16)[e], plain("down_proj"))


def test_mixtral_legacy_names_and_shards(k, tmp_path):
    """Mixtral checkpoints of transformers 4 (block_sparse_moe.experts.<e>.w1 / w3 / w2), split over an
    index of two shards, give the same experts."""
    from safetensors.torch import save_file

    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    stored = read_tensors(MIXTRAL)
    renamed = {}
    for key, t in stored.items():
        parts = key.split(".")
        if ".mlp.experts." in key:
            parts[3], parts[6] = "block_sparse_moe", names[parts[6]]
        renamed[".".join(parts)] = t
    folder = tmp_path / "legacy"
    folder.mkdir()
    shutil.copy(MIXTRAL / "config.json", folder)
    keys = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for file, part in shards.items():
        save_file({key: renamed[key] for key in part}, folder / file)
    index = {"weight_map": {key: file for file, part in shards.items() for key in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    legacy = build_model(MIXTRAL)
    consumed = k.load_quantized_experts(legacy, folder)
    assert all(".block_sparse_moe.experts." in name for name in consumed)
    plain = build_model(MIXTRAL)
    k.load_quantized_experts(plain, MIXTRAL)
    assert_same_experts(experts_of(legacy), experts_of(plain))


def permute_g_idx(t):
    g = t["model.layers.0.mlp.experts.1.gate_proj.g_idx"]
    t["model.layers.0.mlp.experts.1.gate_proj.g_idx"] = g[torch.randperm(g.numel(), generator=torch.Generator().manual_seed(0))]


def set_stored_zero_15(t):
    z = t["model.layers.1.mlp.experts.3.down_proj.qzeros"].clone()
    z[0, 0] = (z[0, 0] & ~0xF) | 0xF
    t["model.layers.1.mlp.experts.3.down_proj.qzeros"] = z


def group_size_16(t):  # K = 128 in groups of 16: 8 groups of the same parameters
    prefix = "model.layers.0.mlp.experts.0.gate_proj"
    for part in ("scales", "qzeros"):
        t[f"{prefix}.{part}"] = t[f"{prefix}.{part}"].repeat_interleave(8 // t[f"{prefix}.{part}"].shape[0], 0)
    t[f"{prefix}.g_idx"] = (torch.arange(128) // 16).to(torch.int32)


def up_in_groups_of_64(t):  # gate_proj in groups of 32, up_proj in groups of 64
    prefix = "model.layers.0.mlp.experts.0.up_proj"
    for part in ("scales", "qzeros"):
        t[f"{prefix}.{part}"] = t[f"{prefix}.{part}"][::2].contiguous()
    t[f"{prefix}.g_idx"] = (torch.arange(128) // 64).to(torch.int32)


BAD_CHECKPOINTS = [
    # (id, fixture, tensors edit, quantization_config edit, error pattern)
    ("act-order", MIXTRAL, permute_g_idx, None, r"experts\.1\.gate_proj\.g_idx is an act-order"),
    ("3-bit", MIXTRAL, None, lambda qc: qc.update(bits=3), r"quantization_config\.bits = 3"),
    ("marlin", MIXTRAL, None, lambda qc: qc.update(format="marlin", checkpoint_format="marlin"),
     r"quantization_config\.(checkpoint_)?format = 'marlin'"),
    ("hqq", MIXTRAL, None, lambda qc: qc.update(quant_method="hqq"), r"quant_method = 'hqq'"),
    ("awq-gemv", MIXTRAL_AWQ, None, lambda qc: qc.update(format="gemv", version="gemv"),
     r"quantization_config\.version = 'gemv'"),
    ("awq-zero-points-not-8", QWEN3_AWQ, None, lambda qc: qc.update(zero_point=False),
     r"experts\.0\.gate_proj\.qzeros: zero_point false expects every zero point to be 8"),
    ("int16-pack", MIXTRAL, None, lambda qc: qc.update(pack_dtype="int16"), r"pack_dtype"),
    ("8-bit-override", MIXTRAL, None, lambda qc: qc.update(dynamic={r"+:.*experts.*": {"bits": 8}}),
     r"dynamic\[.*\]\.bits = 8"),
    ("missing-scales", MIXTRAL, lambda t: t.pop("model.layers.0.mlp.experts.2.up_proj.scales"), None,
     r"no model\.layers\.0\.mlp\.experts\.2\.up_proj\.scales"),
    ("sym-with-zero-points", QWEN3, None, lambda qc: qc.update(sym=True),
     r"experts\.0\.gate_proj\.qzeros: sym=True expects every zero point to be 8"),
    ("v1-zero-16", QWEN3, set_stored_zero_15, None, r"layers\.1\.mlp\.experts\.3\.down_proj\.qzeros holds a stored 15"),
    ("group-size-16", MIXTRAL, group_size_16, None, r"experts\.0\.gate_proj\.scales: group size 16"),
    ("gate-up-groups-differ", MIXTRAL, up_in_groups_of_64, None,
     r"experts\.0\.up_proj\.scales: group size 64 differs from gate_proj's 32"),
    ("expert-bias", MIXTRAL, lambda t: t.update({"model.layers.0.mlp.experts.0.down_proj.bias": torch.zeros(128)}),
     None, r"experts\.0\.down_proj\.bias"),
    ("extra-expert", MIXTRAL,
     lambda t: t.update({f"model.layers.0.mlp.experts.4.{p}": t[f"model.layers.0.mlp.experts.3.{p}"].clone()
                         for p in ("gate_proj.qweight",)}), None, r"experts\.4\.gate_proj\.qweight but the model"),
    ("ct-actorder-group", QWEN3_CT, lambda t: t.update({"model.layers.0.mlp.experts.2.up_proj.weight_g_idx": (
        torch.arange(127, -1, -1) // 64).to(torch.int32)}), None, r"experts\.2\.up_proj\.weight_g_idx is an act-order"),
    ("ct-8-bit", MIXTRAL_CT, None, lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=8),
     r"config_groups\.group_0\.weights\.num_bits = 8"),
    ("ct-activations", MIXTRAL_CT, None, lambda qc: qc["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "float"}), r"group_0\.input_activations"),
    ("ct-dense-format", MIXTRAL_CT, None, lambda qc: qc.update(format="int-quantized"), r"format = 'int-quantized'"),
    ("ct-some-zero-points", QWEN3_CT, lambda t: t.pop("model.layers.1.mlp.experts.0.down_proj.weight_zero_point"),
     None, r"layers\.1\.mlp\.experts: some experts' projections have zero points and others not"),
    ("ct-shape", QWEN3_CT, lambda t: t.update({"model.layers.0.mlp.experts.1.gate_proj.weight_shape":
                                                 torch.tensor([128, 256])}), None,
     r"experts\.1\.gate_proj\.weight_shape must be \[128, 128\]"),
    ("scales-int", MIXTRAL,
     lambda t: t.update({"model.layers.0.mlp.experts.0.down_proj.scales":
                         t["model.layers.0.mlp.experts.0.down_proj.scales"].to(torch.int32)}), None,
     r"experts\.0\.down_proj\.scales must be a float tensor"),
]


@pytest.mark.parametrize("name,fixture,tensors,quantization,error", BAD_CHECKPOINTS, ids=[c[0] for c in BAD_CHECKPOINTS])
def test_refuses(k, tmp_path, name, fixture, tensors, quantization, error):
    """What the format cannot represent exactly is a ValueError naming the tensor or config field, and the
    model is left as it was (nothing swapped before every expert converted)."""
    folder = altered(tmp_path, fixture, tensors, quantization)
    model = build_model(fixture)
    with pytest.raises(ValueError, match=error):
        k.load_quantized_experts(model, folder)
    assert all(not isinstance(layer.mlp.experts.gate_up_proj, k.QuantizedExperts) for layer in model.model.layers)


def test_refuses_models_and_folders_that_do_not_match(k, tmp_path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(MIXTRAL)
    del config.quantization_config
    config.intermediate_size = 256  # another model: the checkpoint's experts are [128, 128]
    other = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.qweight must have shape \(16, 256\)"):
        k.load_quantized_experts(other, MIXTRAL)
    config.intermediate_size, config.num_hidden_layers = 128, 1
    one_layer = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"model has no experts for: model\.layers\.1\.mlp\.experts"):
        k.load_quantized_experts(one_layer, MIXTRAL)
    with pytest.raises(ValueError, match="model: Linear has no experts module"):
        k.load_quantized_experts(torch.nn.Linear(4, 4), MIXTRAL)
    dense = FIXTURES.parent / "w4a16" / "gptqmodel" / "gptq-g64-asym-tied"  # a dense GPTQ Llama
    with pytest.raises(ValueError, match="stores no quantized experts"):
        k.load_quantized_experts(build_model(MIXTRAL), dense)
    with pytest.raises(ValueError, match="no quantization_config"):
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "config.json").write_text("{}")
        k.load_quantized_experts(build_model(MIXTRAL), tmp_path / "plain")
    with pytest.raises(FileNotFoundError):
        k.load_quantized_experts(build_model(MIXTRAL), tmp_path / "absent")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        k.load_quantized_experts(object(), MIXTRAL)
    with pytest.raises(TypeError, match="folder must be a path"):
        k.load_quantized_experts(build_model(MIXTRAL), 3)
    with pytest.raises(TypeError, match="device must be"):
        k.load_quantized_experts(build_model(MIXTRAL), MIXTRAL, device=0)
