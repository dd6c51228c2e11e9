"""examples/gemma3.py's code path on a tiny random Gemma-3 text model (no download): the shared perplexity with a
BOS token before every window, GPTQ's calibration giving each layer its own rotary embeddings, and one variant end to end
(round-to-nearest and GPTQ through the built w4a16 kernel, on its PyTorch path as on a user's CPU).

The real run (examples/gemma3.py on the 270M GGUF) takes many minutes on a CPU and is not part of CI; its
numbers are in docs/benchmarks/e2e-gemma3-cpu-results.json.
"""

import collections
import copy
import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hubtools.e2e.quality import perplexity

ROOT = Path(__file__).resolve().parent.parent
BOS = 2


def load_example():
    spec = importlib.util.spec_from_file_location("gemma3_example", ROOT / "examples" / "gemma3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_gemma3():
    """Six layers, the last one full attention as in Gemma 3's 5:1 pattern, with Gemma-3's two RoPE bases."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16,
                              max_position_embeddings=128, bos_token_id=BOS, pad_token_id=0, eos_token_id=1)
    assert config.layer_types[-1] == "full_attention" and config.layer_types[0] == "sliding_attention"
    return Gemma3ForCausalLM(config).to(torch.bfloat16).eval()


def test_perplexity_prepends_bos_to_each_window(tiny_gemma3):
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = tiny_gemma3(torch.cat([torch.tensor([BOS]), ids])[None]).logits[0, 1:-1].float()
    expected = math.exp(F.cross_entropy(logits, ids[1:]).item())
    assert perplexity(tiny_gemma3, ids, 40, 40, bos_token_id=BOS) == pytest.approx(expected, rel=1e-6)
    # Windows of 21 every 19 tokens, each after its own BOS: the second scores only what the first did not.
    with torch.inference_mode():
        first = tiny_gemma3(torch.cat([torch.tensor([BOS]), ids[:21]])[None]).logits[0, 1:-1].float()
        second = tiny_gemma3(torch.cat([torch.tensor([BOS]), ids[19:]])[None]).logits[0, 2:-1].float()
    nll = F.cross_entropy(first, ids[1:21], reduction="sum") + F.cross_entropy(second, ids[21:], reduction="sum")
    windows = perplexity(tiny_gemma3, ids, 21, 19, bos_token_id=BOS)
    assert windows == pytest.approx(math.exp(nll.item() / 39), rel=1e-6)
    # window == stride: independent chunks of 20, each scoring its tokens after the first (19 + 19)
    with torch.inference_mode():
        second = tiny_gemma3(torch.cat([torch.tensor([BOS]), ids[20:]])[None]).logits[0, 1:-1].float()
    nll = (F.cross_entropy(first[:19], ids[1:20], reduction="sum")
           + F.cross_entropy(second, ids[21:], reduction="sum"))
    chunks = perplexity(tiny_gemma3, ids, 20, 20, bos_token_id=BOS)
    assert chunks == pytest.approx(math.exp(nll.item() / 38), rel=1e-6)


def test_calibration_feeds_each_layer_its_own_keyword_arguments(tiny_gemma3, load_kernel, monkeypatch):
    """Gemma 3's full-attention layers (every sixth) get other rotary embeddings than its sliding-window ones:
    GPTQ's replay must pass each layer the keyword arguments the model's own forward gives it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w4a16 = load_kernel("w4a16")
    model = copy.deepcopy(tiny_gemma3)  # the fixture is shared
    batch = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    seen = collections.defaultdict(list)
    handles = [layer.register_forward_pre_hook(
        lambda module, args, kwargs, i=i: seen[i].append(kwargs["position_embeddings"]), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(batch)
        own = {i: calls[0] for i, calls in seen.items()}
        seen.clear()
        w4a16.quantize_model(model, 64, calibration=[batch], fuse=False)
    finally:
        for h in handles:
            h.remove()
    assert not torch.equal(own[5][0], own[0][0])  # the two RoPE bases differ: the check below can fail
    for i, calls in seen.items():
        assert len(calls) >= 3  # capture, Hessians, outputs for the next layer
        for cos, sin in calls:
            torch.testing.assert_close(cos, own[i][0], rtol=0, atol=0)
            torch.testing.assert_close(sin, own[i][1], rtol=0, atol=0)
    assert sum(isinstance(m, w4a16.W4A16Linear) for m in model.modules()) == 42


@pytest.mark.parametrize("gptq", [False, True, "act-order"])
def test_variant_end_to_end(tiny_gemma3, load_kernel, monkeypatch, gptq):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch path, which the example takes on CPU
    example = load_example()
    w4a16 = load_kernel("w4a16")
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(2))
    calibration = [torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(3))]
    spec = dict(fmt="int4", group_size=64, zero_point=True, gptq=bool(gptq), act_order=gptq == "act-order")
    args = SimpleNamespace(window=24, stride=24)
    row = example.run_variant("int4-g64-zp", spec, tiny_gemma3, SimpleNamespace(bos_token_id=BOS), ids, w4a16, args,
                              calibration)
    assert row["method"] == {False: "round-to-nearest", True: "gptq", "act-order": "gptq act-order"}[gptq]
    # 6 layers x q, k, v, o, gate, up, down; all in_features (64, 64, 128) are multiples of 64
    assert row["layers_per_group_size"] == {"64": 42}
    assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1
    base = example.run_variant("unquantized", None, tiny_gemma3, SimpleNamespace(bos_token_id=BOS), ids, w4a16,
                               args, None)
    # 4-bit codes with a scale and a zero point per 64 weights, rows padded to 128 (much of these tiny layers)
    assert row["weight_bytes"] < 0.65 * base["weight_bytes"]
    # random weights: 4 bits move the perplexity of a near-uniform model (256 tokens) only a little
    assert row["perplexity"] == pytest.approx(base["perplexity"], rel=0.2)
    assert not any(isinstance(m, w4a16.W4A16Linear) for m in tiny_gemma3.modules())  # the variant copied it


def test_report_shows_each_gptq_variant_and_its_goals():
    """The results page's Gemma-3 table gets a row per GPTQ variant (plain and act-order) of a round-to-nearest
    row, and a goal per variant, each against the same round-to-nearest row."""
    from hubtools import report

    def row(variant, method, ppl):
        return {"variant": variant, "format": "int4", "group_size": 128, "zero_point": False, "method": method,
                "perplexity": ppl, "ppl_ratio_vs_unquantized": ppl / 20.0, "weight_bytes": 1e6,
                "layers_per_group_size": {"128": 1}}

    results = {"rows": [dict(row("unquantized", None, 20.0), format="bfloat16", zero_point=None, group_size=None),
                        row("int4-g128", "round-to-nearest", 40.0), row("int4-g128-gptq", "gptq", 31.0),
                        row("int4-g128-gptq-act", "gptq act-order", 28.0)]}
    goals = {g["case"]: g["value"] for g in report.gemma3_goals(results)
             if g["goal"].startswith("int4 g128 GPTQ perplexity increase")}
    assert goals == {"Gemma-3-270M int4-g128-gptq": pytest.approx(0.55),
                     "Gemma-3-270M int4-g128-gptq-act": pytest.approx(0.4)}
