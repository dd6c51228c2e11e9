"""Batch-1 greedy decode of whole Llama-architecture models: bf16 against the w4a16 and rmsnorm kernels.

Models are built from ``transformers.LlamaConfig`` with random weights (nothing is downloaded) at the
shapes of Qwen2.5-1.5B and Llama-3-8B, in bf16. Each model runs four configurations, in this order on
the same weights:

- ``bf16``: the stock ``transformers`` model;
- ``w4a16``: ``w4a16.quantize_model`` (int4, symmetric, group 128) on every ``nn.Linear`` but ``lm_head``, q/k/v
  and gate/up fused into one matmul each (its default);
- ``w4a16+rmsnorm``: that, plus ``kernels.kernelize`` mapping ``RMSNorm`` to the rmsnorm kernel's layer;
- ``w4a16+rmsnorm+fused``: that, plus ``rmsnorm.fuse_residual_norms``: each residual add runs fused with the norm
  after it (``residual + attn_out`` with the post-attention norm, ``residual + mlp_out`` with the next layer's input
  norm or the final norm), one ``fused_add_rms_norm`` in place of an add and a norm;
- ``w4a16+rmsnorm+fused+lm_head``: that, with ``lm_head`` at int4 too (the largest single matmul of a decode step;
  with tied embeddings the embedding keeps its bf16 copy).

Protocol (one model at a time, one configuration at a time):

1. Prefill a fixed random prompt into a ``transformers.StaticCache``; every configuration starts decoding
   from the bf16 prefill's greedy token.
2. One decode step (forward of one token, argmax written back into the input buffer) is captured in a
   ``torch.cuda.CUDAGraph``; the cache's position counter is a device tensor the step advances, so each
   replay is one full greedy step. Positions are reset to the prompt length before every pass, so every
   configuration is timed over the same context range [prompt, prompt + steps).
3. Correctness: a free-running greedy pass, and a teacher-forced pass (the bf16 tokens fed back) whose
   logits are compared with bf16's (relative error, top-1 agreement).
4. Timing: ``steps`` graph replays between CUDA events, repeated ``reps`` times; the best pass is reported.
5. Breakdown: a few eager decode steps under ``torch.profiler``; every CUDA kernel is assigned to the
   innermost annotated module that launched it (``nn.Linear`` / ``W4A16Linear`` / a ``GateUpMLP`` running the
   SwiGLU epilogue -> matmul, ``*RMSNorm`` and the rmsnorm kernel's ops -> norms (so the fused residual adds, which
   run inside the decoder layers, count as norms), ``*Attention`` minus its projections -> attention: RoPE,
   KV-cache write, GQA repeat, SDPA; all else -> rest: embedding, unfused residual adds, SiLU*mul, masks, argmax); the
   categories' shares of kernel time are scaled to the graph step time, so they sum to it (launch gaps are
   spread pro rata).
   Each matmul kind's time per call there is set beside the same call alone (CUDA-graph replay over the
   model's modules of that kind, on the input shape it gets in the model).
6. Roofline: device copy bandwidth measured eagerly in the same run; bytes per token counted two ways
   (`decode_bytes`); ceiling tokens/s = copy bandwidth / bytes.

On the CPU (``--device cpu``, for tests) the same code runs eagerly, without CUDA graphs, and its times are
no performance claim.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ..measure import environment, time_graph
from ..workspace import REPO_ROOT
from .norms import kernelize_rmsnorm

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "e2e-decode-results.json"
CPU_OUT = REPO_ROOT / "out" / "e2e-decode-cpu.json"  # git-ignored: CPU runs never overwrite GPU results

CONFIGS = ("bf16", "w4a16", "w4a16+rmsnorm", "w4a16+rmsnorm+fused", "w4a16+rmsnorm+fused+lm_head")
LM_HEAD_CONFIG = CONFIGS[-1]
CATEGORIES = ("matmul", "attention", "norms", "rest")
GROUP_SIZE = 128
ANNOTATION = "e2e::"
# The goals: w4a16 decode tokens/s over bf16 tokens/s, per model.
GOALS = {"qwen2.5-1.5b": 2.0, "llama-3-8b": 2.5}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    eps: float
    rope_theta: float

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden, intermediate_size=self.intermediate, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            vocab_size=self.vocab, tie_word_embeddings=self.tied, attention_bias=self.qkv_bias,
            rms_norm_eps=self.eps, rope_theta=self.rope_theta, max_position_embeddings=4096,
            attn_implementation="sdpa",
        )


MODELS = {
    "qwen2.5-1.5b": ModelSpec("qwen2.5-1.5b", 1536, 8960, 28, 12, 2, 128, 151936, True, True, 1e-6, 1e6),
    "llama-3-8b": ModelSpec("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256, False, False, 1e-5, 5e5),
    # For tests: every dimension the kernels tile is a multiple of 128 (group 128); qkv bias like Qwen, but
    # untied: a tied random model just repeats its input token (its own logit dominates), a vacuous check.
    "tiny": ModelSpec("tiny", 128, 256, 2, 4, 2, 32, 512, False, True, 1e-6, 1e4),
}


@dataclasses.dataclass
class Kernels:
    """The built kernels: the loaded w4a16 and rmsnorm modules, and the rmsnorm build folder (holding ``build/``,
    for kernelize's ``LocalLayerRepository``)."""

    w4a16: object
    rmsnorm: object
    rmsnorm_dir: Path


def load_kernels(tmp: Path) -> Kernels:
    """Build w4a16 and rmsnorm with the real builder into `tmp` and load them as the Hub would."""
    from ..build import build_kernel, load_build
    from ..workspace import Workspace

    workspace = Workspace.load()
    w4a16_dir = build_kernel(workspace.kernel("w4a16"), tmp)
    rmsnorm_dir = build_kernel(workspace.kernel("rmsnorm"), tmp)
    return Kernels(w4a16=load_build(w4a16_dir), rmsnorm=load_build(rmsnorm_dir), rmsnorm_dir=rmsnorm_dir)


# ---------------------------------------------------------------------------------------------------
# Models and configurations


def build_model(spec: ModelSpec, device: str, seed: int = 0) -> nn.Module:
    """A random-weight bf16 ``LlamaForCausalLM`` created directly on `device`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(spec.config(), dtype=torch.bfloat16)
    if spec.qkv_bias:  # Qwen2 has biases on q/k/v only; LlamaConfig's attention_bias also gives o_proj one
        for layer in model.model.layers:
            layer.self_attn.o_proj.bias = None
    with torch.no_grad():
        for module in model.modules():  # norms start at ones: randomize so a wrong weight would show
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 1.5)
            elif isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.02)
    return model.eval()


def quantize(model: nn.Module, kernels: Kernels) -> nn.Module:
    return kernels.w4a16.quantize_model(model, group_size=GROUP_SIZE, skip=("lm_head",), zero_point=False,
                                        fmt="int4")


def apply_config(model: nn.Module, config: str, kernels: Kernels, device: str, state: dict) -> dict:
    """Bring `model` (bf16, or already partly converted as recorded in `state`) to `config`, in place."""
    info = {}
    if config != "bf16" and not state.get("quantized"):
        started = time.perf_counter()
        quantize(model, kernels)
        if device != "cpu":
            torch.cuda.synchronize()
        state["quantized"] = True
        info["quantize_seconds"] = time.perf_counter() - started
    if config in CONFIGS[2:] and not state.get("kernelized"):
        from kernels import LocalLayerRepository

        repository = LocalLayerRepository(repo_path=kernels.rmsnorm_dir, layer_name="RMSNorm")
        info["norms_kernelized"], _ = kernelize_rmsnorm(model, repository, device)
        state["kernelized"] = True
    if config in CONFIGS[3:] and not state.get("fused"):  # after kernelize, which would undo part of it
        info["residual_adds_fused"] = kernels.rmsnorm.fuse_residual_norms(model)
        state["fused"] = True
    if config == LM_HEAD_CONFIG and not state.get("lm_head"):  # the one nn.Linear left; nothing more to fuse
        kernels.w4a16.quantize_model(model, group_size=GROUP_SIZE, skip=(), zero_point=False, fmt="int4", fuse=False)
        info["lm_head_quantized"] = state["lm_head"] = True
    if config == "bf16" and state:
        raise ValueError("bf16 must run before the model is converted")
    return info


def dequantized_reference(model: nn.Module, kernels: Kernels, lm_head: bool = False) -> nn.Module:
    """A bf16 copy of `model` whose quantized linears (with `lm_head`, lm_head too) hold the dequantized int4
    weights (same codes as `quantize`): the function the w4a16 configurations compute, on PyTorch's bf16 matmul."""
    ref = copy.deepcopy(model)
    k = kernels.w4a16
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, nn.Linear) and (lm_head or not name.endswith("lm_head")):
                qw = k.quantize(module.weight, group_size=GROUP_SIZE, zero_point=False, fmt="int4")
                module.weight.copy_(k.dequantize(qw, module.weight.dtype))
    return ref


# ---------------------------------------------------------------------------------------------------
# Decoding


class Decoder:
    """Greedy batch-1 decode over a static KV cache; on CUDA the step is a captured CUDA graph."""

    def __init__(self, model: nn.Module, prompt: torch.Tensor, cache_len: int, *, use_graph: bool,
                 first_token: Optional[torch.Tensor] = None):
        from transformers import StaticCache

        self.model, self.prompt_len = model, prompt.shape[1]
        self.device = prompt.device
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len)
        with torch.no_grad():
            logits = model(input_ids=prompt, past_key_values=self.cache, use_cache=True).logits
        own_first = logits[:, -1].argmax(-1).view(1, 1)
        self.first = (own_first if first_token is None else first_token.view(1, 1)).clone()
        self.ids = self.first.clone()
        self.graph = None
        self.logits = None
        self.capture_error = None
        if use_graph:
            try:
                self._capture()
            except Exception as exc:  # noqa: BLE001  (recorded in the results; timing falls back to eager)
                self.graph, self.logits = None, None
                self.capture_error = f"{type(exc).__name__}: {exc}"[:500]
                torch.cuda.synchronize()
                self.reset()

    def _step(self) -> torch.Tensor:
        out = self.model(input_ids=self.ids, past_key_values=self.cache, use_cache=True)
        logits = out.logits[:, -1, :]
        self.ids.copy_(logits.argmax(-1, keepdim=True))
        return logits

    def reset(self) -> None:
        """Positions back to the prompt length, input back to the first decoded token."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(self.prompt_len)
        self.ids.copy_(self.first)

    def _capture(self, warmup: int = 3) -> None:
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):  # Triton compiles, cuBLAS handles, allocator pools
                    self._step()
            torch.cuda.current_stream().wait_stream(stream)
            self.reset()
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._step()
            self.reset()
            torch.cuda.synchronize()

    def step(self) -> torch.Tensor:
        """One greedy step; returns the step's logits [1, vocab] (a static buffer under graphs)."""
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        with torch.no_grad():
            return self._step()

    def run(self, n: int, forced: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` steps from the prompt: (greedy tokens [n], float32 logits [n, vocab]). With `forced`, token
        i fed to step i + 1 is forced[i] (teacher forcing), not this model's own choice."""
        self.reset()
        tokens, logits = [], []
        for i in range(n):
            logits.append(self.step().float().reshape(-1).clone())
            tokens.append(self.ids.reshape(()).clone())
            if forced is not None:
                self.ids.copy_(forced[i].view(1, 1))
        return torch.stack(tokens), torch.stack(logits)

    def time_steps(self, n: int, reps: int) -> list[float]:
        """Seconds per token of `n` steps from the prompt, `reps` times (CUDA: graph replays between events)."""
        out = []
        for _ in range(reps):
            self.reset()
            if self.graph is not None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(n):
                    self.graph.replay()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / 1e3 / n)
            else:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(n):
                    self.step()
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                out.append((time.perf_counter() - started) / n)
        return out

    def release(self) -> None:
        self.graph = None
        self.logits = None
        self.cache = None


# ---------------------------------------------------------------------------------------------------
# Per-step breakdown


def category(module: nn.Module) -> Optional[str]:
    name = type(module).__name__
    if isinstance(module, nn.Linear) or name == "W4A16Linear":
        return "matmul"
    if name == "GateUpMLP" and module.swiglu:  # its own kernels are the gate/up matmul with the SiLU-and-mul epilogue
        return "matmul"
    if name.endswith("RMSNorm"):
        return "norms"
    if name.endswith("Attention"):
        return "attention"
    return None


def _matmul_kind(name: str, module: nn.Module) -> str:
    """What a matmul module is in the model, from its attribute name: q_proj / k_proj / ... unfused, qkv and gate_up
    fused (`w4a16.fusion`), gate_up+swiglu for a GateUpMLP running the epilogue, lm_head."""
    return "gate_up+swiglu" if type(module).__name__ == "GateUpMLP" else name.rpartition(".")[2]


def _labels(model: nn.Module) -> dict:
    """{module: annotation label}: its category, and for matmuls ``matmul/<kind>``."""
    labels = {}
    for name, module in model.named_modules():
        cat = category(module)
        if cat is not None:
            labels[module] = f"{cat}/{_matmul_kind(name, module)}" if cat == "matmul" else cat
    return labels


def _annotate(labels: dict) -> list:
    """Forward hooks that wrap each categorized module's call in a profiler range `e2e::<label>` (`_labels`)."""
    stack, handles = [], []
    for module, label in labels.items():
        def pre(mod, args, label=label):
            rf = torch.profiler.record_function(ANNOTATION + label)
            rf.__enter__()
            stack.append(rf)

        def post(mod, args, output):
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


# The rmsnorm kernel's ops (op namespace `_rmsnorm_<build>`): fused with a residual add they run in a decoder layer's
# own forward, not inside an RMSNorm module, so they are recognised by name.
NORM_OPS = ("rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_inplace")


def _is_norm_op(name: str) -> bool:
    namespace, _, op = name.partition("::")
    return namespace.startswith("_rmsnorm_") and op in NORM_OPS


def _label_of(event) -> str:
    """The label of the innermost annotated module (or rmsnorm op: "norms") around `event`, else "rest"."""
    while event is not None:
        if event.name.startswith(ANNOTATION):
            return event.name[len(ANNOTATION):]
        if _is_norm_op(event.name):
            return "norms"
        event = event.cpu_parent
    return "rest"


def attribute(events, on_device: bool) -> tuple[dict, float, dict, dict]:
    """Time per annotation label (microseconds: `_labels`, "rest" for the unclaimed) from profiler events, the
    fraction attributed to a module, {(kernel name, category): [microseconds, launches]} (device only), and
    the number of calls of each label.

    On a device, the durations of the kernels (and memcpy / memset) each CPU op launched, under its
    innermost annotation; device time no op claims goes to "rest". On the CPU, every op's self time."""
    from torch.autograd import DeviceType

    raw: dict = {"rest": 0.0}
    top: dict = {}
    calls: dict = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith(ANNOTATION):
            label = e.name[len(ANNOTATION):]
            calls[label] = calls.get(label, 0) + 1
    if on_device:
        total = sum(e.time_range.elapsed_us() for e in events
                    if e.device_type != DeviceType.CPU and not e.name.startswith(ANNOTATION))
        for e in events:
            if e.device_type != DeviceType.CPU:
                continue
            for k in e.kernels:
                if not k.name.startswith(ANNOTATION):
                    label = _label_of(e)
                    raw[label] = raw.get(label, 0.0) + k.duration
                    entry = top.setdefault((k.name[:100], label.partition("/")[0]), [0.0, 0])
                    entry[0] += k.duration
                    entry[1] += 1
        claimed = sum(raw.values())
        if claimed > total > 0:  # an event attached twice: keep shares, cap at the device total
            raw = {c: v * total / claimed for c, v in raw.items()}
            claimed = total
        raw["rest"] += max(total - claimed, 0.0)
        return raw, (claimed / total if total else 0.0), top, calls
    for e in events:
        if e.device_type == DeviceType.CPU:
            label = _label_of(e)
            raw[label] = raw.get(label, 0.0) + e.self_cpu_time_total
    return raw, 1.0, top, calls


def _matmul_microbenchmarks(labels: dict, x_by_kind: dict) -> dict:
    """{kind: seconds per call} of each matmul kind alone, on the input shape it gets in the model, by CUDA-graph
    replay rotating over the model's modules of that kind (each layer's own weight, so L2-cold as in the model)."""
    modules: dict = {}
    for module, label in labels.items():
        if label.startswith("matmul/"):
            modules.setdefault(label.partition("/")[2], []).append(module)
    seconds = {}
    for kind, x in x_by_kind.items():
        calls = [m.gate_up.swiglu if kind == "gate_up+swiglu" else m for m in modules[kind]]
        with torch.no_grad():
            seconds[kind] = time_graph(lambda i, calls=calls, x=x: calls[i](x), len(calls))
    return seconds


def _capture_matmul_inputs(labels: dict) -> tuple[dict, list]:
    """Hooks that keep one input (a fresh random tensor of its shape and dtype) per matmul kind."""
    inputs, handles = {}, []
    for module, label in labels.items():
        if label.startswith("matmul/"):
            def pre(mod, args, kind=label.partition("/")[2]):
                if kind not in inputs:
                    inputs[kind] = torch.randn_like(args[0])
            handles.append(module.register_forward_pre_hook(pre))
    return inputs, handles


def profile_breakdown(decoder: Decoder, steps: int, step_seconds: float) -> dict:
    """Eager steps under torch.profiler; category shares scaled to `step_seconds` (they sum to it); each matmul
    kind's in-model time per call beside its microbenchmark (device only) at the same input shape."""
    from torch.profiler import ProfilerActivity, profile

    on_device = decoder.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    model = decoder.model
    decoder.reset()
    labels = _labels(model)
    inputs, hooks = _capture_matmul_inputs(labels)
    try:
        with torch.no_grad():
            decoder._step()  # warm (outside the profile)
    finally:
        for h in hooks:
            h.remove()
    decoder.reset()
    handles = _annotate(labels)
    try:
        with torch.no_grad(), profile(activities=activities) as prof:
            for _ in range(steps):
                decoder._step()
            if on_device:
                torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    by_label, claimed, top, calls = attribute(prof.events(), on_device)
    raw = dict.fromkeys(CATEGORIES, 0.0)
    for label, us in by_label.items():
        raw[label.partition("/")[0]] += us
    total = sum(raw.values())
    if total <= 0:
        raise RuntimeError("the profiler recorded no time for the decode steps")
    micro, micro_error = {}, None
    if on_device:
        try:
            micro = _matmul_microbenchmarks(labels, inputs)
        except Exception as exc:  # noqa: BLE001  (a failed microbenchmark must not lose the breakdown)
            micro_error = f"{type(exc).__name__}: {exc}"[:300]
    kinds = []
    for label, us in sorted(by_label.items()):
        cat, _, kind = label.partition("/")
        if cat == "matmul":
            n = calls.get(label, 0)
            kinds.append({"kind": kind, "calls_per_step": n / steps, "input_shape": list(inputs[kind].shape),
                          "in_model_us_per_call": us / max(n, 1),
                          "micro_us_per_call": 1e6 * micro[kind] if kind in micro else None})
    return {
        "seconds": {c: step_seconds * raw[c] / total for c in CATEGORIES},
        "busy_seconds_per_step": {c: raw[c] / 1e6 / steps for c in CATEGORIES},
        "attributed_fraction": claimed,
        "profiled_steps": steps,
        "matmul_kinds": kinds,
        **({"micro_error": micro_error} if micro_error else {}),
        "top_kernels": [{"name": name, "category": cat, "us_per_step": us / steps, "launches_per_step": n / steps}
                        for (name, cat), (us, n) in sorted(top.items(), key=lambda kv: -kv[1][0])[:15]],
    }


# ---------------------------------------------------------------------------------------------------
# Bytes per token


def _ideal_matrix_bytes(n: int, k: int) -> int:
    """An all-int4 matrix: N*K/2 code bytes + one 16-bit scale per group of GROUP_SIZE per row."""
    return n * k // 2 + math.ceil(k / GROUP_SIZE) * n * 2


def decode_bytes(model: nn.Module, *, cache_len: int, context_len: float) -> tuple[dict, dict]:
    """Bytes one decode step must read, by part: (actual, ideal).

    actual: what this configuration streams: every matrix as stored (bf16, or packed int4 codes + scales
    (+ zero points) with its padding), lm_head included (bf16 here: with tied embeddings that is the whole
    embedding matrix), biases, the embedding row, the norms' weights, and the KV cache as the stock SDPA
    path moves it: the static buffer of `cache_len` positions is read, and with grouped-query attention
    `repeat_kv` writes an expanded copy that SDPA reads again; plus the new token's K and V.
    ideal: the same model with every matrix (lm_head too) at 4 bits + group scales, and the KV cache read
    once at `context_len` (the mean context of the timed steps). Activations and logits (tens of KB) are
    left out of both."""
    cfg = model.config
    actual = dict.fromkeys(("matrices", "biases", "embedding_row", "norms", "kv_cache"), 0)
    ideal = dict(actual)
    seen = set()
    for module in model.modules():
        name = type(module).__name__
        if name == "W4A16Linear":
            n, k = module.out_features, module.in_features
            actual["matrices"] += sum(t.numel() * t.element_size() for t in (module.qweight, module.scales,
                                                                             module.zeros) if t is not None)
            ideal["matrices"] += _ideal_matrix_bytes(n, k)
        elif isinstance(module, nn.Linear):
            w = module.weight
            actual["matrices"] += w.numel() * w.element_size()
            ideal["matrices"] += _ideal_matrix_bytes(*w.shape)
        elif isinstance(module, nn.Embedding):
            row = module.embedding_dim * module.weight.element_size()
            actual["embedding_row"] += row
            ideal["embedding_row"] += row
        elif name.endswith("RMSNorm"):
            b = module.weight.numel() * module.weight.element_size()
            actual["norms"] += b
            ideal["norms"] += b
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and id(bias) not in seen:
            seen.add(id(bias))
            actual["biases"] += bias.numel() * bias.element_size()
            ideal["biases"] += bias.numel() * bias.element_size()
    esize = torch.finfo(torch.bfloat16).bits // 8
    kv_heads, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_position = 2 * head_dim * esize  # K and V of one head at one position
    layers = cfg.num_hidden_layers
    streamed = kv_heads + (2 * heads if heads > kv_heads else 0)  # read buffer (+ write, read the repeat)
    actual["kv_cache"] = layers * per_position * (cache_len * streamed + kv_heads)
    ideal["kv_cache"] = int(layers * per_position * kv_heads * context_len)
    return actual, ideal


# ---------------------------------------------------------------------------------------------------
# The run


@dataclasses.dataclass
class Settings:
    prompt_len: int = 16
    steps: int = 128
    check_steps: int = 32
    reps: int = 5
    profile_steps: int = 3
    seed: int = 0

    @property
    def cache_len(self) -> int:
        return self.prompt_len + max(self.steps, self.check_steps)

    @property
    def context_len(self) -> float:
        """Mean number of cached positions a timed step attends to (the new one included)."""
        return self.prompt_len + (self.steps + 1) / 2


def _correctness(tokens, logits, ref_tokens, ref_logits, forced_logits) -> dict:
    agree = tokens == ref_tokens
    prefix = int(agree.long().cumprod(0).sum().item())
    diff = (forced_logits - ref_logits).norm() / ref_logits.norm()
    top1 = (forced_logits.argmax(-1) == ref_tokens).float().mean()
    return {"greedy_tokens_matching_prefix": prefix, "greedy_tokens_equal_fraction": agree.float().mean().item(),
            "teacher_forced_top1_agreement": top1.item(), "teacher_forced_logits_rel_err": diff.item(),
            "tokens": tokens.tolist()}


def run_model(spec: ModelSpec, kernels: Kernels, device: str, settings: Settings, copy_bw: Optional[float],
              configs=CONFIGS, on_row: Callable[[dict], None] = lambda row: None,
              log: Callable[[str], None] = print) -> list[dict]:
    """Measure every configuration of one model; `on_row` is called after each (incremental results)."""
    started = time.perf_counter()
    model = build_model(spec, device, settings.seed)
    build_seconds = time.perf_counter() - started
    gen = torch.Generator().manual_seed(settings.seed + 1)
    prompt = torch.randint(0, spec.vocab, (1, settings.prompt_len), generator=gen).to(device)
    state, ref, rows = {}, None, []
    bf16_tps = None
    for config in [c for c in CONFIGS if c in configs]:
        try:
            row = _run_config(model, spec, config, kernels, device, settings, copy_bw, prompt, state, ref,
                              bf16_tps, build_seconds)
        except Exception as exc:  # noqa: BLE001  (one failed configuration must not lose the others)
            import traceback

            traceback.print_exc()
            row = {"model": spec.name, "config": config, "device": device, "error": f"{type(exc).__name__}: {exc}"[:1000]}
            if device != "cpu":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        if config == "bf16" and "error" not in row:
            bf16_tps = row["tokens_per_s"]
            ref = row.pop("_ref")
            for key in sorted({_dequantized_key(c) for c in configs if c != "bf16"}):
                try:
                    ref[key] = _dequantized_run(model, kernels, prompt, settings, ref, device != "cpu",
                                                lm_head=key == _dequantized_key(LM_HEAD_CONFIG))
                except Exception as exc:  # noqa: BLE001
                    log(f"{spec.name}: dequantized reference failed: {type(exc).__name__}: {exc}")
        row.pop("_ref", None)
        rows.append(row)
        on_row(row)
        if "error" in row:
            log(f"{spec.name} {config}: FAILED {row['error']}")
            continue
        log(f"{spec.name} {config}: {row['tokens_per_s']:.1f} tok/s ({row['ms_per_token']:.3f} ms/token)"
            + (f", {row['speedup_vs_bf16']:.2f}x bf16" if row["speedup_vs_bf16"] else "")
            + (f", {100 * row['fraction_of_actual_ceiling']:.0f}% of actual / "
               f"{100 * row['fraction_of_ideal_ceiling']:.0f}% of ideal ceiling" if copy_bw else "")
            + ("; breakdown ms " + " ".join(f"{c}={1e3 * v:.3f}" for c, v in row["breakdown"].items())
               if row["breakdown"] else f"; no breakdown: {row['breakdown_detail'].get('error')}")
            + ("" if row["graph"] or device == "cpu" else f"; NO GRAPH: {row.get('capture_error')}"))
        for kind in row["breakdown_detail"].get("matmul_kinds", []):
            if kind["micro_us_per_call"]:
                log(f"  {kind['kind']}: {kind['calls_per_step']:g} calls/step, in the model "
                    f"{kind['in_model_us_per_call']:.1f} us/call, alone {kind['micro_us_per_call']:.1f} us/call")
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return rows


def _dequantized_key(config: str) -> str:
    """The dequantized reference a w4a16 configuration is checked against (lm_head dequantized too, or not)."""
    return "dequant_lm_head" if config == LM_HEAD_CONFIG else "dequant"


def _dequantized_run(model, kernels, prompt, settings, ref, use_graph, lm_head) -> dict:
    """Greedy tokens and teacher-forced logits of the bf16 model with dequantized int4 weights: what the
    w4a16 configurations must reproduce up to bf16 rounding (the kernels' correctness at full size)."""
    reference = dequantized_reference(model, kernels, lm_head)
    decoder = Decoder(reference, prompt, settings.cache_len, use_graph=use_graph, first_token=ref["first"])
    try:
        tokens, _ = decoder.run(settings.check_steps)
        _, forced = decoder.run(settings.check_steps, forced=ref["tokens"])
    finally:
        decoder.release()
        del decoder, reference
        if use_graph:
            torch.cuda.empty_cache()
    return {"tokens": tokens, "forced_logits": forced}


def _run_config(model, spec, config, kernels, device, settings, copy_bw, prompt, state, ref, bf16_tps,
                build_seconds) -> dict:
    use_graph = device != "cpu"
    info = apply_config(model, config, kernels, device, state)
    decoder = Decoder(model, prompt, settings.cache_len, use_graph=use_graph,
                      first_token=None if ref is None else ref["first"])
    try:
        tokens, logits = decoder.run(settings.check_steps)
        new_ref = None
        if ref is None and config == "bf16":
            new_ref = {"first": decoder.first.clone(), "tokens": tokens, "logits": logits}
            correctness = {"reference": True, "tokens": tokens.tolist()}
        elif ref is not None:
            _, forced = decoder.run(settings.check_steps, forced=ref["tokens"])
            correctness = _correctness(tokens, logits, ref["tokens"], ref["logits"], forced)
            if _dequantized_key(config) in ref:
                dq = ref[_dequantized_key(config)]
                check = _correctness(tokens, forced, dq["tokens"], dq["forced_logits"], forced)
                check.pop("tokens")
                correctness["vs_dequantized_bf16"] = check
            del forced
        else:
            correctness = {"reference": False, "tokens": tokens.tolist()}
        times = decoder.time_steps(settings.steps, settings.reps)
        step = min(times)
        try:
            breakdown = profile_breakdown(decoder, settings.profile_steps, step)
        except Exception as exc:  # noqa: BLE001  (no profiler data must not lose the timing)
            breakdown = {"seconds": None, "error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        graph_used = decoder.graph is not None
        capture_error = decoder.capture_error
        decoder.release()
        del decoder
        if device != "cpu":
            torch.cuda.empty_cache()
    actual, ideal = decode_bytes(model, cache_len=settings.cache_len, context_len=settings.context_len)
    bytes_actual, bytes_ideal = sum(actual.values()), sum(ideal.values())
    tps = 1.0 / step
    row = {
        "model": spec.name, "config": config, "device": device, "graph": graph_used,
        "tokens_per_s": tps, "ms_per_token": 1e3 * step, "seconds_per_token": step,
        "seconds_per_token_median": statistics.median(times), "seconds_per_token_all": times,
        "breakdown": breakdown["seconds"], "breakdown_detail": {k: v for k, v in breakdown.items() if k != "seconds"},
        "bytes_actual": bytes_actual, "bytes_actual_parts": actual,
        "bytes_ideal": bytes_ideal, "bytes_ideal_parts": ideal,
        "speedup_vs_bf16": tps / bf16_tps if bf16_tps else (1.0 if config == "bf16" else None),
        "correctness": correctness, "model_build_seconds": build_seconds, **info,
    }
    if capture_error:
        row["capture_error"] = capture_error
    if copy_bw:
        row["ceiling_actual_tokens_per_s"] = copy_bw / bytes_actual
        row["ceiling_ideal_tokens_per_s"] = copy_bw / bytes_ideal
        row["fraction_of_actual_ceiling"] = tps / row["ceiling_actual_tokens_per_s"]
        row["fraction_of_ideal_ceiling"] = tps / row["ceiling_ideal_tokens_per_s"]
        row["achieved_bytes_per_s"] = bytes_actual * tps
    if new_ref is not None:
        row["_ref"] = new_ref
    return row


METHOD = {
    "models": "transformers LlamaForCausalLM from LlamaConfig, random weights (std 0.02; norm weights U(0.5, 1.5)), "
              "bf16, sdpa attention; qwen2.5-1.5b: tied embeddings, biases on q/k/v only; llama-3-8b: untied, "
              "default RoPE (the llama3 frequency scaling changes no shapes or bytes)",
    "configs": "bf16: stock model; w4a16: w4a16.quantize_model(group_size=128, skip=('lm_head',), "
               "zero_point=False, fmt='int4') (lm_head stays bf16; q/k/v and gate/up fused, its default); w4a16+rmsnorm: plus kernels.kernelize "
               "(Mode.INFERENCE) with LocalLayerRepository on the built rmsnorm kernel for RMSNorm; "
               "w4a16+rmsnorm+fused: plus rmsnorm.fuse_residual_norms (every residual add fused with the norm after "
               "it: the post-attention norm, the next layer's input norm, the final norm); w4a16+rmsnorm+fused+lm_head: "
               "plus lm_head at int4 (the same quantize_model settings; a tied embedding keeps its bf16 copy)",
    "tokens_per_s": "batch 1, greedy; one decode step (forward + argmax fed back) captured in a torch.cuda.CUDAGraph "
                    "over a transformers StaticCache; positions reset to the prompt length, then `steps` replays "
                    "between CUDA events; best of `reps` passes",
    "breakdown": "eager decode steps under torch.profiler; each CUDA kernel assigned to the innermost module "
                 "that launched it (Linear/W4A16Linear/GateUpMLP with the SwiGLU epilogue -> matmul incl. lm_head and bias "
                 "adds; RMSNorm and the rmsnorm kernel's ops -> norms (fused residual adds included); "
                 "Attention minus its projections -> attention: RoPE, KV-cache write, GQA repeat_kv, SDPA; "
                 "anything else -> rest); shares of kernel time scaled to the graph step time "
                 "(busy_seconds_per_step holds the unscaled eager kernel time)",
    "matmul_kinds": "per matmul kind (q_proj ... or the fused qkv / gate_up+swiglu, lm_head): its kernels' time per call "
                    "in those profiled steps, beside the same call alone on the input shape it gets in the model, by "
                    "CUDA-graph replay over the model's modules of that kind (L2-cold weights, as in the model)",
    "bytes": "see hubtools.e2e.decode.decode_bytes: actual = stored matrices (int4 codes + bf16 scales with padding, "
             "bf16 lm_head / tied embedding), biases, embedding row, norm weights, KV cache as the stock path moves "
             "it (static buffer of cache_len read, repeat_kv copy written and read); ideal = every matrix incl. "
             "lm_head at 4 bits + group-128 bf16 scales, KV read once at the mean timed context",
    "ceilings": "ceiling tokens/s = copy_bandwidth / bytes; copy bandwidth: eager 1 GiB device copy with events, "
                "read + write counted (hubtools.measure.measure_copy_bandwidth), same run",
    "correctness": "every config decodes from the bf16 prefill's greedy token; free-running greedy tokens compared "
                   "with bf16's, and a teacher-forced pass (bf16 tokens fed back) compared by logits relative error "
                   "and top-1 agreement. Random-weight logits are nearly flat, so int4 noise flips near-ties: "
                   "a short matching prefix is expected and is not an error. vs_dequantized_bf16: the same "
                   "checks against the bf16 model holding the dequantized int4 weights (the function the w4a16 "
                   "configs compute), which tests the kernels at full size: logits agree to bf16 rounding "
                   "amplified by depth, while a wrong kernel gives a relative error near 1",
}


def goals(results: dict) -> list[dict]:
    """The issue's goals evaluated on the measured rows, shaped like the kernel bench modules' goals."""
    return [{"goal": "decode tokens/s / bf16 tokens/s", "case": f"{r['model']} {r['config']}",
             "value": r["speedup_vs_bf16"], "target": GOALS[r["model"]], "met": r["speedup_vs_bf16"] >= GOALS[r["model"]]}
            for r in results["rows"]
            if r["model"] in GOALS and r.get("config") != "bf16" and r.get("speedup_vs_bf16") is not None]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e_decode.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["qwen2.5-1.5b", "llama-3-8b"])
    parser.add_argument("--tiny", action="store_true", help="same as --models tiny (a CPU-sized Llama)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompt-len", type=int, default=Settings.prompt_len)
    parser.add_argument("--steps", type=int, default=Settings.steps, help="timed decode steps per pass")
    parser.add_argument("--check-steps", type=int, default=Settings.check_steps, help="steps compared with bf16")
    parser.add_argument("--reps", type=int, default=Settings.reps, help="timed passes (best reported)")
    parser.add_argument("--profile-steps", type=int, default=Settings.profile_steps)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results JSON (default: {DEFAULT_OUT.relative_to(REPO_ROOT)} on CUDA, "
                             f"{CPU_OUT.relative_to(REPO_ROOT)} on the CPU)")
    args = parser.parse_args(argv)
    models = ["tiny"] if args.tiny else args.models
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    if "bf16" not in args.configs:
        parser.error("--configs must include bf16 (the baseline every speed-up is measured against)")
    out = args.out or (DEFAULT_OUT if args.device == "cuda" else CPU_OUT)
    settings = Settings(args.prompt_len, args.steps, args.check_steps, args.reps, args.profile_steps)

    copy_bw = None
    if args.device == "cuda":
        from ..measure import measure_copy_bandwidth, warm_clocks

        warm_clocks()
        copy_bw = measure_copy_bandwidth()
        print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    command = None if argv is None else ["scripts/e2e_decode.py", *argv]
    results = {"benchmark": "e2e-decode", "env": environment(command, args.device), "copy_bandwidth": copy_bw,
               "settings": {**dataclasses.asdict(settings), "cache_len": settings.cache_len,
                            "context_len": settings.context_len, "group_size": GROUP_SIZE, "dtype": "bfloat16",
                            "batch": 1},
               "method": METHOD, "models": {m: dataclasses.asdict(MODELS[m]) for m in models},
               "rows": []}
    if args.device == "cpu":
        results["notes"] = ["CPU run: eager, no CUDA graphs; times are no performance claim."]

    def write(row=None) -> None:
        if row is not None:
            results["rows"].append(row)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")

    write()
    with tempfile.TemporaryDirectory() as tmp:
        kernels = load_kernels(Path(tmp))
        for name in models:
            run_model(MODELS[name], kernels, args.device, settings, copy_bw, args.configs, on_row=write,
                      log=lambda s: print(s, flush=True))
    print(f"wrote {out}")
    for goal in goals(results):
        print(f"{goal['case']}: {goal['value']:.2f}x bf16 tokens/s, goal >= {goal['target']}x: "
              f"{'met' if goal['met'] else 'MISSED'}")
    return 0
