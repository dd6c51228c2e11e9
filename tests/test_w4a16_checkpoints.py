"""w4a16.load_checkpoint / from_pretrained on checkpoints made by the quantizing tools themselves.

Each folder under tests/fixtures/w4a16/<tool>/ was made by scripts/make_fixtures.py w4a16 <tool> with the tool
(GPTQModel, llm-compressor, AutoAWQ) from a tiny random Llama; its reference.json holds the tool versions and
the logits of the tool's own CPU inference of that folder. The tools are not installed here: the tests read
only the committed files. Refusals are tested on edited copies of those folders.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "w4a16"
FOLDERS = sorted(p.parent for p in FIXTURES.glob("*/*/reference.json"))
IDS = [f"{p.parent.name}/{p.name}" for p in FOLDERS]
# Both sides run the same float16 model (the tools' plain PyTorch paths dequantize to float16 weights, w4a16
# keeps them in fp32 and rounds each product once) and round activations to float16 after every op, so each
# is ~1e-3 (of the largest |logit|) from the float32 model with the same dequantized weights: measured 1.0e-3
# for a plain float16 run of those weights, 1.1e-3 for w4a16 and GPTQModel's PyTorch kernel, and 1.0-1.6e-3
# between w4a16 and every tool here. 5e-3 leaves margin for the sum of both sides' noise; GPTQModel's default
# CPU kernel (aten int4pack, bfloat16 scales) is 6.4e-3 off, so the bound also tells such roundings apart.
TOL = 5e-3


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("w4a16")


def _reference(folder: Path) -> dict:
    return json.loads((folder / "reference.json").read_text())


def _logits(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(input_ids)).logits.float()


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / folder.name
    shutil.copytree(folder, out)
    return out


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    qc = config["quantization_config"]
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        target = qc
        for part in parents:
            target = target[part]
        target[last] = value
    path.write_text(json.dumps(config))
    (folder / "quantize_config.json").unlink(missing_ok=True)


def _fixture(tool: str, name: str) -> Path:
    folder = FIXTURES / tool / name
    if not (folder / "reference.json").is_file():
        pytest.fail(f"fixture {tool}/{name} is missing")
    return folder


def test_fixtures_exist():
    assert {p.parent.name for p in FOLDERS} == {"gptqmodel", "llmcompressor", "autoawq"}
    assert len(FOLDERS) == 13


@pytest.mark.parametrize("folder", FOLDERS, ids=IDS)
def test_matches_the_tools_own_logits(k, monkeypatch, folder):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch path: the Triton paths are tested below and in test_w4a16
    reference = _reference(folder)
    model = k.from_pretrained(folder, dtype=torch.float16)
    linears = [m for m in model.modules() if isinstance(m, k.W4A16Linear)]
    assert len(linears) >= 14  # q, k, v, o, gate, up, down in each of the 2 layers
    theirs = torch.tensor(reference["logits"])
    assert _close(_logits(model, reference["input_ids"]), theirs) < TOL


def test_the_comparison_catches_a_misread(k, monkeypatch, tmp_path):
    """A control for TOL: the v2 asymmetric fixture read as v1 (every zero point off by one, which the
    loader cannot detect without sym) lands far outside it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    folder = _copy(_fixture("gptqmodel", "gptq-v2-g32-asym"), tmp_path)
    _edit_config(folder, checkpoint_format="gptq", format="gptq")
    reference = _reference(folder)
    misread = _close(_logits(k.from_pretrained(folder), reference["input_ids"]), torch.tensor(reference["logits"]))
    assert misread > 5 * TOL


def test_what_the_fixtures_exercise(k):
    """The layouts the fixtures are there for really reach the loader: act-order, a quantized lm_head, tied
    embeddings, unquantized lm_head, per-channel scales, biases of quantized linears."""
    actorder = k.from_pretrained(_fixture("gptqmodel", "gptq-g32-actorder"))
    assert any(m.perm is not None for m in actorder.modules() if isinstance(m, k.W4A16Linear))
    assert type(actorder.lm_head) is torch.nn.Linear
    assert isinstance(k.from_pretrained(_fixture("gptqmodel", "gptq-g128-lm-head")).lm_head, k.W4A16Linear)
    for tool, name in (("gptqmodel", "gptq-g64-asym-tied"), ("llmcompressor", "w4a16-asym-g128-tied")):
        tied = k.from_pretrained(_fixture(tool, name))
        assert tied.lm_head.weight is tied.model.embed_tokens.weight
        assert tied.model.layers[0].mlp.down_proj.zeros is not None  # asymmetric: zero points kept
    # AWQ with zero_point false (GPTQModel's default) takes the symmetric kernels; AutoAWQ's keeps zero points.
    assert k.from_pretrained(_fixture("gptqmodel", "awq-g64")).model.layers[0].mlp.up_proj.zeros is None
    assert k.from_pretrained(_fixture("autoawq", "gemm-g64")).model.layers[0].mlp.up_proj.zeros is not None
    channel = k.from_pretrained(_fixture("gptqmodel", "gptq-per-channel"))
    assert channel.model.layers[0].self_attn.q_proj.group_size == -1
    for tool, name in (("gptqmodel", "gptq-g64-asym-bias"), ("llmcompressor", "w4a16-g128-bias")):
        biased = k.from_pretrained(_fixture(tool, name))
        linears = [m for m in biased.modules() if isinstance(m, k.W4A16Linear)]
        assert all(m.bias is not None and bool(m.bias.abs().sum() > 0) for m in linears)


def test_triton_path_matches_too(k, path):
    folder = _fixture("gptqmodel", "gptq-g32-actorder")
    reference = _reference(folder)
    model = k.from_pretrained(folder, dtype=torch.float16)
    assert _close(_logits(model, reference["input_ids"]), torch.tensor(reference["logits"])) < TOL


def test_load_into_a_model_built_by_hand(k, monkeypatch):
    """load_checkpoint into a transformers model the user built on the meta device."""
    import transformers

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    folder = _fixture("llmcompressor", "w4a16-g128")
    config = transformers.AutoConfig.from_pretrained(folder)
    del config.quantization_config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    # Non-persistent buffers (rotary frequencies) made on meta have no values: refused, not run as garbage.
    with pytest.raises(ValueError, match="inv_freq"):
        k.load_checkpoint(model, folder)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)  # on the CPU
    k.load_checkpoint(model, folder)
    reference = _reference(folder)
    assert _close(_logits(model.eval(), reference["input_ids"]), torch.tensor(reference["logits"])) < TOL


def test_sharded_index(k, monkeypatch, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    folder = _copy(_fixture("gptqmodel", "gptq-g64-asym-tied"), tmp_path)
    with safe_open(folder / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, folder / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in shard_names})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    reference = _reference(folder)
    model = k.from_pretrained(folder, dtype=torch.float16)
    assert _close(_logits(model, reference["input_ids"]), torch.tensor(reference["logits"])) < TOL


def test_autogptq_folder_layout(k, monkeypatch, tmp_path):
    """AutoGPTQ's older folders: quantize_config.json beside a config.json without quantization_config, the
    weights in <model_file_base_name>.safetensors. Same tensors as GPTQModel's v1 (this folder is the
    GPTQModel fixture rearranged that way, not AutoGPTQ output)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    folder = _copy(_fixture("gptqmodel", "gptq-g32-actorder"), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    qc = config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    autogptq = {key: qc[key] for key in ("bits", "group_size", "desc_act", "sym")}
    (folder / "quantize_config.json").write_text(json.dumps({**autogptq, "model_file_base_name": "gptq_model-4bit-32g"}))
    (folder / "model.safetensors").rename(folder / "gptq_model-4bit-32g.safetensors")
    reference = _reference(folder)
    model = k.from_pretrained(folder, dtype=torch.float16)
    assert _close(_logits(model, reference["input_ids"]), torch.tensor(reference["logits"])) < TOL
    (folder / "quantize_config.json").write_text(json.dumps({**autogptq, "is_marlin_format": True}))
    with pytest.raises(ValueError, match="is_marlin_format"):
        k.from_pretrained(folder)


def test_autoawq_folder_layout(k, monkeypatch, tmp_path):
    """AutoAWQ's older folders: quant_config.json (w_bit, q_group_size, version; no quant_method) beside a
    config.json without quantization_config (the AutoAWQ fixture rearranged that way)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    folder = _copy(_fixture("autoawq", "gemm-g64"), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 64, "w_bit": 4,
                                                          "version": "GEMM"}))
    reference = _reference(folder)
    assert _close(_logits(k.from_pretrained(folder), reference["input_ids"]), torch.tensor(reference["logits"])) < TOL


def test_dtype_applies_to_dense_tensors_only(k):
    """dtype= sets the embeddings, norms and activations; scales keep the checkpoint's float16 (exact)."""
    model = k.from_pretrained(_fixture("llmcompressor", "w4a16-asym-g128-tied"), dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.bfloat16
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.scales.dtype == torch.float16 and q_proj.weight_dtype == torch.float16
    assert model(torch.tensor([[1, 2, 3]])).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("tool, name, changes, field", [
    ("gptqmodel", "gptq-g32-actorder", {"bits": 3}, "bits"),
    ("gptqmodel", "gptq-g32-actorder", {"bits": 8}, "bits"),
    ("gptqmodel", "gptq-g32-actorder", {"checkpoint_format": "marlin"}, "checkpoint_format"),
    ("gptqmodel", "gptq-g32-actorder", {"checkpoint_format": "gptq_p"}, "checkpoint_format"),
    ("gptqmodel", "gptq-g32-actorder", {"pack_dtype": "int16"}, "pack_dtype"),
    ("gptqmodel", "gptq-g32-actorder", {"dynamic": {r"+:.*down_proj": {"bits": 8}}}, "dynamic"),
    # What GPTQModel writes for lm_head=True unless told otherwise: an 8-bit lm_head.
    ("gptqmodel", "gptq-g128-lm-head", {"dynamic": {"lm_head": {"bits": 8, "group_size": 32, "sym": True}}},
     "dynamic"),
    ("gptqmodel", "gptq-g64-asym-tied", {"dynamic": {r"+:.*q_proj": {"sym": True}}}, "dynamic"),
    ("gptqmodel", "gptq-g32-actorder", {"format": "gptq_v2"}, "must agree"),
    ("gptqmodel", "gptq-g32-actorder", {"quant_method": "exl2"}, "quant_method"),
    ("gptqmodel", "gptq-g32-actorder", {"quant_method": "bitsandbytes"}, "quant_method"),
    ("gptqmodel", "awq-g64", {"version": "gemv"}, "version"),
    ("gptqmodel", "awq-g64", {"version": "exllama"}, "version"),
    ("gptqmodel", "awq-g64", {"bits": 3}, "bits"),
    ("gptqmodel", "awq-g64", {"zero_point": "yes"}, "zero_point"),
    # AutoAWQ's zeros are not all 8: declared symmetric, the importer refuses them instead of dropping them.
    ("autoawq", "gemm-g64", {"zero_point": False}, "zero point to be 8"),
    ("llmcompressor", "w4a16-g128", {"config_groups__group_0__weights__num_bits": 8}, "num_bits"),
    ("llmcompressor", "w4a16-g128", {"config_groups__group_0__weights__type": "float"}, "type"),
    ("llmcompressor", "w4a16-g128", {"config_groups__group_0__weights__strategy": "block"}, "strategy"),
    ("llmcompressor", "w4a16-g128", {"config_groups__group_0__input_activations": {"num_bits": 8}},
     "input_activations"),
    ("llmcompressor", "w4a16-g128", {"format": "marlin-24"}, "format"),
    ("llmcompressor", "w4a16-g128", {"quantization_status": "frozen"}, "quantization_status"),
    ("llmcompressor", "w4a16-g128", {"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
])
def test_refuses_what_it_does_not_read(k, tmp_path, tool, name, changes, field):
    folder = _copy(_fixture(tool, name), tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=field):
        k.from_pretrained(folder)


def test_refuses_moe_expert_tensors(k, tmp_path):
    """Quantized experts (as GPTQ / AWQ MoE checkpoints store them) are refused, pointing to moe-dispatch's
    expert loader: a tiny Mixtral built on meta, and a checkpoint whose expert linears are quantized."""
    import transformers
    from safetensors.torch import save_file

    folder = tmp_path / "moe"
    folder.mkdir()
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                        vocab_size=64)
    config.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                  "checkpoint_format": "gptq"}
    config.save_pretrained(folder)
    prefix = "model.layers.0.mlp.experts.0.gate_proj"
    save_file({f"{prefix}.qweight": torch.zeros(8, 128, dtype=torch.int32),
               f"{prefix}.qzeros": torch.zeros(2, 16, dtype=torch.int32),
               f"{prefix}.scales": torch.ones(2, 128, dtype=torch.float16)}, folder / "model.safetensors")
    with pytest.raises(ValueError, match="MoE expert.*load_quantized_experts"):
        k.from_pretrained(folder)


def test_tied_lm_head_stored_beside_the_embedding(k, monkeypatch, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    folder = _copy(_fixture("gptqmodel", "gptq-g64-asym-tied"), tmp_path)
    with safe_open(folder / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert "lm_head.weight" not in tensors
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, folder / "model.safetensors")
    model = k.from_pretrained(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = _reference(folder)
    assert _close(_logits(model, reference["input_ids"]), torch.tensor(reference["logits"])) < TOL


def test_refuses_incomplete_or_foreign_checkpoints(k, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = _copy(_fixture("gptqmodel", "gptq-per-channel"), tmp_path)
    with safe_open(folder / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    save_file({n: t for n, t in tensors.items() if n != "model.norm.weight"}, folder / "model.safetensors")
    with pytest.raises(ValueError, match="no tensor for model.norm.weight"):
        k.from_pretrained(folder)
    save_file({**tensors, "model.layers.7.extra.weight": torch.zeros(2)}, folder / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.7.extra.weight"):
        k.from_pretrained(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        k.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "quantize_config.json").unlink()
    with pytest.raises(ValueError, match="quantization_config"):
        k.from_pretrained(folder)


def test_refuses_groups_the_format_cannot_hold(k, tmp_path):
    """Groups of 16 (valid GPTQ, not a w4a16 group size): the error names the layer and the group size."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = _copy(_fixture("gptqmodel", "gptq-g32-actorder"), tmp_path)
    with safe_open(folder / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    prefix = "model.layers.0.self_attn.q_proj"
    tensors[f"{prefix}.scales"] = tensors[f"{prefix}.scales"].repeat_interleave(2, dim=0)
    tensors[f"{prefix}.qzeros"] = tensors[f"{prefix}.qzeros"].repeat_interleave(2, dim=0)
    tensors[f"{prefix}.g_idx"] = (torch.arange(128) // 16).int()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=f"{prefix}: group_size must be"):
        k.from_pretrained(folder)


def test_wrong_argument_types(k, tmp_path):
    folder = _fixture("gptqmodel", "gptq-per-channel")
    with pytest.raises(TypeError, match="model"):
        k.load_checkpoint("model", folder)
    with pytest.raises(TypeError, match="folder"):
        k.load_checkpoint(torch.nn.Linear(2, 2), 3)
    with pytest.raises(TypeError, match="dtype"):
        k.load_checkpoint(torch.nn.Linear(2, 2), folder, dtype="float16")
    with pytest.raises(TypeError, match="dtype"):
        k.from_pretrained(folder, dtype=torch.int8)
    with pytest.raises(TypeError, match="dtype"):  # W4A16Linear takes float16 / bfloat16 activations
        k.from_pretrained(folder, dtype=torch.float32)
    with pytest.raises(TypeError, match="device"):
        k.load_checkpoint(torch.nn.Linear(2, 2), folder, device=0.5)
    with pytest.raises(TypeError, match="model_class"):
        k.from_pretrained(folder, model_class=torch.nn.Linear)
    with pytest.raises(FileNotFoundError, match="missing"):
        k.load_checkpoint(torch.nn.Linear(2, 2), tmp_path / "missing")


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values [R, C] -> int32 [R, C/8], element j of a word in bits 4j..4j+3 (as
    compressed-tensors packs), written independently of the importer."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for j in range(8):
        words |= values[:, j::8].long() << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("asym", [False, True])
def test_compressed_tensors_act_order(k, monkeypatch, asym):
    """weight_g_idx (llm-compressor's "group" act-order, in checkpoints it wrote before removing it) and zero
    points: the dequantized weight is (code - zero) * scale[g_idx] in the original column order."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = torch.Generator().manual_seed(3)
    n, kk, group = 40, 256, 64
    codes = torch.randint(0, 16, (n, kk), generator=g)
    zeros = torch.randint(0, 16, (n, kk // group), generator=g) if asym else torch.full((n, kk // group), 8)
    scales = (torch.rand(n, kk // group, generator=g) * 0.1 + 0.01).half()
    g_idx = torch.randperm(kk, generator=g) // group
    packed_zeros = _pack_rows(zeros.t().contiguous()).t().contiguous() if asym else None
    qw = k.from_compressed_tensors(_pack_rows(codes), scales, torch.tensor([n, kk]), packed_zeros, g_idx.int())
    expected = (codes - zeros.gather(1, g_idx.expand(n, -1))) * scales.float().gather(1, g_idx.expand(n, -1))
    assert torch.equal(k.dequantize(qw, torch.float32), expected)
    with pytest.raises(ValueError, match="weight_packed"):
        k.from_compressed_tensors(_pack_rows(codes)[:, :-1], scales, (n, kk))
    with pytest.raises(TypeError, match="weight_scale"):
        k.from_compressed_tensors(_pack_rows(codes), scales.int(), (n, kk))


def test_load_speed_measurement(k, tmp_path):
    """The loading benchmark (`python -m hubtools.bench.w4a16 --load-speed DEVICE`) writes a GPTQ checkpoint the
    loader takes and times both sides."""
    from hubtools.bench.w4a16 import load_speed

    results = load_speed(k, tmp_path / "ckpt", layers=2, n=256, k=384, repeats=1)
    (row,) = results["rows"]
    assert row["load_seconds"] > 0 and row["read_seconds"] > 0 and row["bytes"] > 2 * 256 * 384 // 2
    assert results["mode"] == "load-speed" and results["device"] == "cpu"
