"""Probe (issue 13's quality goal, not in the package): how much 4-bit rounding costs Gemma-3-270M by an outside
reference. Every nn.Linear but lm_head gets its weight rounded by the `gguf` package's own llama.cpp reference
quantizers (Q4_0: blocks of 32, one scale; Q4_1: blocks of 32, a scale and a float minimum; no importance matrix)
and dequantized back; beside them w4a16's round-to-nearest at the same group size (32, zero points), and GPTQ with
act-order at groups of 64 and 32 (zero points; the calibration of `examples/gemma3.py`). Same text, window and model
as `examples/gemma3.py`. Run from the repository root:

    PYTHONPATH=.:examples python docs/design/w4a16/e26-gguf-reference-probe.py unquantized gguf-q4_0 gguf-q4_1 \
        int4-g32-zp int4-g64-zp-gptq-act int4-g32-zp-gptq-act
"""

import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

import gemma3 as example
from hubtools.build import build_kernel, load_build
from hubtools.e2e.quality import calibration_batches, load_text, perplexity
from hubtools.e2e.quality import quantize as quantize_layers
from hubtools.workspace import Workspace

torch.set_num_threads(2)
ROOT = Path(__file__).resolve().parents[3]
GGUF_TYPES = {"gguf-q4_0": GGMLQuantizationType.Q4_0, "gguf-q4_1": GGMLQuantizationType.Q4_1}


def gguf_round_trip(model, qtype) -> int:
    """Each linear weight but lm_head through quantize + dequantize of `qtype` (blocks along in_features)."""
    layers = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            w = module.weight.detach().to(torch.float32).numpy()
            packed = quantize(np.ascontiguousarray(w), qtype)
            module.weight.data = torch.from_numpy(dequantize(packed, qtype).reshape(w.shape)).to(module.weight.dtype)
            layers += 1
    return layers


model, tokenizer, _, _ = example.load_gemma3()
ids = load_text(tokenizer, 1024)
calibration = None
with tempfile.TemporaryDirectory() as build_dir:
    w4a16 = load_build(build_kernel(Workspace.load(ROOT).kernel("w4a16"), Path(build_dir)))
    for variant in sys.argv[1:]:
        m = copy.deepcopy(model)
        start = time.time()
        if variant in GGUF_TYPES:
            layers = gguf_round_trip(m, GGUF_TYPES[variant])
        elif variant == "int4-g32-zp":
            layers = sum(quantize_layers(m, w4a16, "int4", 32, True).values())
        elif variant in ("int4-g64-zp-gptq-act", "int4-g32-zp-gptq-act"):
            if calibration is None:
                calibration = calibration_batches(copy.deepcopy(model).to(torch.float32), tokenizer, "cpu",
                                                  **example.CALIBRATION)
            group_size = int(variant.split("-")[1][1:])
            layers = sum(quantize_layers(m, w4a16, "int4", group_size, True, calibration, act_order=True).values())
        else:
            assert variant == "unquantized", variant
            layers = 0
        ppl = perplexity(m, ids, 512, 512, bos_token_id=tokenizer.bos_token_id)
        print(json.dumps({"variant": variant, "layers": layers, "ppl": round(ppl, 4),
                          "s": round(time.time() - start, 1)}), flush=True)
