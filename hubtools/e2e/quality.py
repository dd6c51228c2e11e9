"""Perplexity and 4-bit quantization of a transformers causal LM, shared by the real-model examples
(examples/smollm2.py, examples/gemma3.py): the evaluation text, GPTQ calibration text the model writes itself,
`w4a16.quantize_model` with a group-size fallback, sliding-window perplexity and weight storage."""

from __future__ import annotations

import argparse
import copy
import inspect
import math
import sys

import torch
import torch.nn.functional as F

from ..workspace import REPO_ROOT

TEXT = REPO_ROOT / "examples" / "data" / "alice-chapter1.txt"
TEXT_METHOD = ("sliding windows; each token after the first scored once, with at least window - stride tokens "
               "of context outside the first window")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_text_args(parser: argparse.ArgumentParser, max_tokens: int | None, window: int, stride: int) -> None:
    """The quality examples' text options (their defaults differ per model)."""
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="use only the first N tokens of the text")
    parser.add_argument("--window", type=int, default=window, help="perplexity window (tokens)")
    parser.add_argument("--stride", type=int, default=stride, help="perplexity stride (tokens)")


def check_text_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0 < args.stride <= args.window:
        parser.error("need 0 < --stride <= --window")


def load_text(tokenizer, max_tokens: int | None) -> torch.Tensor:
    """Token ids of the evaluation text (its first line, naming the source, left out)."""
    text = TEXT.read_text().split("\n", 1)[1].strip()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    return ids[:max_tokens]


@torch.inference_mode()
def calibration_batches(model, tokenizer, device, sequences: int, tokens: int, seed: int) -> list[torch.Tensor]:
    """GPTQ calibration text written by the model itself: `sequences` sampled continuations of its BOS token, in
    batches of 4 (deterministic for `seed` on one machine)."""
    torch.manual_seed(seed)
    bos = torch.full((sequences, 1), tokenizer.bos_token_id, dtype=torch.long, device=device)
    out = copy.deepcopy(model).to(device).generate(
        bos, do_sample=True, temperature=1.0, top_p=None, top_k=None, max_new_tokens=tokens - 1,
        min_new_tokens=tokens - 1, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return list(out.split(4))


def gptq_true_sequential(w4a16) -> bool:
    """`w4a16.quantize_model`'s GPTQ stage default, recorded in results files because it changes the *-gptq rows
    (true-sequential stages came after the first 8 x 256 / 16 x 256 runs)."""
    return inspect.signature(w4a16.quantize_model).parameters["true_sequential"].default


def quantize(model, w4a16, fmt: str, group_size: int, zero_point: bool, calibration=None,
             act_order: bool = False) -> dict[int, int]:
    """`w4a16.quantize_model` on every nn.Linear but lm_head (GPTQ on `calibration` when given, columns in order of
    decreasing Hessian diagonal with `act_order`); returns {group size: layers}.

    The kernel needs in_features divisible by the group size. A layer it does not divide (SmolLM2's hidden
    size is 576 = 4.5 x 128) gets the largest group size the kernel takes that divides its in_features (64
    for 576), in a second pass.
    """
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    misfits = [n for n, m in linears.items() if group_size > 0 and m.in_features % group_size]
    w4a16.quantize_model(model, group_size, skip=("lm_head", *misfits), zero_point=zero_point, fmt=fmt,
                         calibration=calibration, act_order=act_order)
    counts = {group_size: len(linears) - len(misfits)}
    for fallback in (64, 32):
        fits = [n for n in misfits if linears[n].in_features % fallback == 0]
        rest = [n for n in linears if n not in fits]
        if fits:
            w4a16.quantize_model(model, fallback, skip=("lm_head", *rest), zero_point=zero_point, fmt=fmt,
                                 calibration=calibration, act_order=act_order)
            counts[fallback] = len(fits)
        misfits = [n for n in misfits if n not in fits]
    if misfits:
        raise ValueError(f"no supported group size divides in_features of {misfits}")
    return {g: n for g, n in counts.items() if n}


@torch.inference_mode()
def perplexity(model, ids: torch.Tensor, window: int, stride: int, bos_token_id: int | None = None) -> float:
    """exp(mean negative log-likelihood) over tokens 1..n-1 of `ids`, each scored once.

    Windows of `window` tokens start every `stride` tokens; a window scores only the tokens no earlier
    window scored, so every token outside the first window is predicted from at least window - stride
    tokens of context (with window == stride: independent chunks). With `bos_token_id` every window is
    preceded by that token (Gemma's outputs are far off without it: perplexity 158 instead of 24 on this
    text), which adds context but no scored token.
    """
    total, count, scored_until = 0.0, 0, 1  # token 0 has no context to be predicted from
    for start in range(0, ids.numel() - 1, stride):
        end = min(start + window, ids.numel())
        inputs = ids[None, start:end]
        if bos_token_id is not None:
            inputs = torch.cat([inputs.new_full((1, 1), bos_token_id), inputs], dim=1)
        # the logits after ids[start] .. ids[end - 2], which predict ids[start + 1] .. ids[end - 1]
        logits = model(inputs).logits[0, inputs.shape[1] - (end - start):-1].float()
        targets = ids[start + 1:end]
        first = max(scored_until - (start + 1), 0)  # index of the first target not scored yet
        total += F.cross_entropy(logits[first:], targets[first:], reduction="sum").item()
        count += targets.numel() - first
        scored_until = end
        if end == ids.numel():
            break
    return math.exp(total / count)


def storage_bytes(tensors) -> int:
    """Bytes of distinct tensors (a tied weight counts once)."""
    seen = {}
    for t in tensors:
        if t is not None:
            seen[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()
    return sum(seen.values())


def linear_weight_bytes(model, w4a16) -> int:
    """Storage of the linear layers that quantization replaces: 4-bit weights with their scales, zero
    points, codebook and padding, or the float weights of the unquantized model."""
    tensors = []
    for name, module in model.named_modules():
        if isinstance(module, w4a16.W4A16Linear):
            tensors += list(module.buffers()) + list(module.parameters())
        elif isinstance(module, torch.nn.Linear) and name != "lm_head":
            tensors += list(module.parameters())
    return storage_bytes(tensors)
