"""moe-dispatch's GPTQ experts importer against checkpoints made by GPTQModel itself (CPU).

The fixtures (tests/fixtures/moe_dispatch/, made by tests/fixtures/moe_dispatch/maker.py through
scripts/make_moe_dispatch_fixtures.py) are a tiny random Mixtral and a tiny random Qwen3-MoE quantized by
GPTQModel from random-token calibration, with the logits GPTQModel's own CPU inference computed from the
saved folder. Here `load_quantized_experts` puts the experts into moe-dispatch's 4-bit format and they run
in its kernels (Triton through the interpreter, and the PyTorch path); attention, whose quantized linears
moe-dispatch does not take, is dequantized with the plain GPTQ formula in this file, as GPTQModel's
TorchLinear does, and everything else is loaded as stored. Every parameter of the model is NaN before
loading, so anything left unloaded shows in the logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures" / "moe_dispatch"
GPTQMODEL = ["mixtral-gptq-g32-sym", "qwen3-moe-gptq-g64-asym-actorder-static"]


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


def load(k, folder: Path, model=None):
    """The fixture's model: experts through moe-dispatch, the rest from the checkpoint in plain torch."""
    model = build_model(folder) if model is None else model
    consumed = set(k.load_quantized_experts(model, folder))
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = {name: t for name, t in read_tensors(folder).items() if name not in consumed}
    linears = sorted(name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight"))
    state = {}
    for prefix in linears:
        parts = {part: tensors.pop(f"{prefix}.{part}") for part in ("qweight", "qzeros", "scales", "g_idx")}
        state[f"{prefix}.weight"] = dequantize_gptq(parts, qc["sym"], qc["checkpoint_format"])
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


# Tolerance against GPTQModel's logits. Both sides compute with the same float16 weights (the checkpoint's
# codes, zero points and scales: GPTQModel's TorchLinear dequantizes (q - zero) * scale to float16 and
# matmuls; moe-dispatch's kernels dequantize the same values in registers, the test's attention the same way
# in plain torch), so the difference is float16 rounding of the activations in a different order (grouped
# experts, summed in another order, fp32 accumulators in other places): a few roundings of 2^-11 relative
# per layer, two layers, ~1e-3 of the logits' norm. 1e-2 relative (and 4x that against the max for any
# element) leaves room for that and is still far below what a wrong expert costs (the experts rolled by one,
# measured below, move the logits by ~0.3-0.5 relative).
TOL = 1e-2


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("name", GPTQMODEL)
def test_gptqmodel_moe_matches_tool_logits(k, path, monkeypatch, name):
    folder = FIXTURES / "gptqmodel" / name
    reference = json.loads((folder / "reference.json").read_text())
    model = load(k, folder)
    for layer in model.model.layers:
        assert isinstance(layer.mlp.experts.gate_up_proj, k.QuantizedExperts)
        assert isinstance(layer.mlp.experts.down_proj, k.QuantizedExperts)
    settings = reference["settings"]
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj
    assert gate_up.group_size == settings["group_size"] and (gate_up.zeros is None) == settings["sym"]
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
