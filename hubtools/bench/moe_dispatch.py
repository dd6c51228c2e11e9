"""moe-dispatch benchmark cases (GPU, bf16, CUDA-graph replay).

`ours` is the whole layer, `moe_forward` (router GEMM, top-k routing, sort by expert, both expert
GEMMs with gather / SwiGLU / routing weight, combine); the skewed case times `fused_experts` on
Zipf-distributed ids. Baselines, measured in the same run:

- "weight-stream bound": bytes of the experts the routing selects (gate, up, down) at the copy
  bandwidth measured in this run, the floor of any implementation at small T;
- "torch._grouped_mm": only the two expert GEMMs, on tokens already gathered and sorted by expert
  (no routing, gather, activation, weighting or combine);
- 4-bit experts (`<model> 4bit-<format> T=<tokens>`, `run_4bit`): moe_forward with `QuantizedExperts` against the
  4-bit weight-stream bound (packed words, scales and zero points of the selected experts / copy bandwidth);
- "per-expert loop": transformers' eager experts loop (gather rows, two cuBLAS GEMMs, SiLU * up,
  weight, index_add_) made capturable: each input's routing is computed ahead and each expert's token
  rows are static index tensors, so no host sync happens inside the graph.

L2 stays cold: `copies` random copies of the layer (weights and router) rotate call by call together
with the inputs, 2-3 copies, as memory allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..measure import (
    environment,
    measure_copy_bandwidth,
    measure_matmul_flops,
    rotation_count,
    time_graph,
    warm_clocks,
)

BYTES = 2  # bf16


@dataclass(frozen=True)
class Model:
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    routing: dict
    tokens: tuple[int, ...]

    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.intermediate * BYTES


MODELS = {
    "mixtral-8x7b": Model(8, 2, 4096, 14336, dict(scoring="softmax", renormalize=True),
                          (1, 16, 128, 1024, 4096, 16384)),
    "deepseek-v3": Model(256, 8, 7168, 2048, dict(scoring="sigmoid", renormalize=True, num_groups=8, topk_groups=4,
                                                  scaling_factor=2.5), (1, 16, 128, 1024, 4096)),
    "qwen3-30b-a3b": Model(128, 8, 2048, 768, dict(scoring="softmax", renormalize=True),
                           (1, 16, 128, 1024, 4096, 16384)),
}
SKEWED_TOKENS = 4096
ZIPF_EXPONENT = 1.2
GOALS = {  # model -> (ours / weight-stream bound time at T=1, at most); Qwen3-30B-A3B: issue 16's 85 %
    "mixtral-8x7b": 1 / 0.88,
    "deepseek-v3": 1 / 0.75,
    "qwen3-30b-a3b": 1 / 0.85,
}
GROUPED_MM_GOAL = 0.8  # ours TFLOP/s over torch._grouped_mm TFLOP/s, T >= 4096
# 4-bit experts (issue 16): moe_forward with QuantizedExperts at T = 1 against the 4-bit weight-stream bound
# (bytes of the selected experts' packed words, scales and zero points / copy bandwidth: at least 85 % of it),
# and against bf16 moe_forward at the same T, measured in the same run (T = 8-512 faster; T >= 4096 at least
# 0.8x its TFLOP/s)
QUANT_FORMATS = {"int4-g128": dict(group_size=128, fmt="int4", zero_point=False)}
QUANT_TOKENS = (1, 16, 128, 4096)
QUANT_BOUND_GOAL = 1 / 0.85  # 4-bit ours time / 4-bit weight-stream bound at T = 1, at most
QUANT_LARGE_GOAL = 0.8  # bf16 ours time / 4-bit ours time at T >= 4096 (the same flops), at least
QUANT_SPEEDUP_GOAL = 3.0  # bf16 ours time / 4-bit ours time at T = 1 (4x fewer weight bytes)
QUANT_MAX_COPIES = 16  # Qwen3-30B-A3B: 19 MB of 4-bit experts per call, 16 copies of its layer are 5 GB
LOOP_GOAL = 3.0  # loop time over ours, every T <= 4096


@dataclass
class Layer:
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    router: torch.Tensor
    bias: torch.Tensor | None


def make_layers(model: Model, copies: int, device: torch.device | str = "cuda") -> list[Layer]:
    E, H, I = model.experts, model.hidden, model.intermediate
    layers = []
    for _ in range(copies):
        w_gate_up = torch.empty(E, 2 * I, H, device=device, dtype=torch.bfloat16).normal_(0, H**-0.5)
        w_down = torch.empty(E, H, I, device=device, dtype=torch.bfloat16).normal_(0, I**-0.5)
        router = torch.empty(E, H, device=device, dtype=torch.bfloat16).normal_(0, H**-0.5)
        bias = torch.randn(E, device=device) * 0.01 if model.routing["scoring"] == "sigmoid" else None
        layers.append(Layer(w_gate_up, w_down, router, bias))
    return layers


def zipf_ids(model: Model, tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k distinct experts per token, expert e drawn with probability ~ 1 / (rank_e + 1)^ZIPF_EXPONENT."""
    probs = 1.0 / torch.arange(1, model.experts + 1, device="cuda", dtype=torch.float32) ** ZIPF_EXPONENT
    perm = torch.randperm(model.experts, device="cuda", generator=generator)
    ids = torch.multinomial(probs[perm].expand(tokens, -1), model.top_k, generator=generator)
    weights = torch.rand(tokens, model.top_k, device="cuda", generator=generator) + 0.1
    return weights / weights.sum(1, keepdim=True), ids.int()


class Case:
    """One (model, T, routing) case: rotated inputs, the routing each input gets, the baselines' inputs."""

    def __init__(self, k, model: Model, layers: list[Layer], tokens: int, skewed: bool, seed: int):
        self.k, self.model, self.layers, self.tokens, self.skewed = k, model, layers, tokens, skewed
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.xs = [torch.randn(tokens, model.hidden, device="cuda", generator=g).bfloat16() for _ in layers]
        self.routes = []
        for x, layer in zip(self.xs, layers):
            if skewed:
                self.routes.append(zipf_ids(model, tokens, g))
            else:  # the routing moe_forward computes: logits in the router's dtype, then route
                self.routes.append(k.route(F.linear(x, layer.router), model.top_k, correction_bias=layer.bias,
                                           **model.routing))

    @property
    def label(self) -> str:
        return f"{'skewed ' if self.skewed else ''}T={self.tokens}"

    def ours(self, i: int) -> torch.Tensor:
        layer, m = self.layers[i], self.model
        if self.skewed:
            weights, ids = self.routes[i]
            return self.k.fused_experts(self.xs[i], layer.w_gate_up, layer.w_down, weights, ids)
        return self.k.moe_forward(self.xs[i], layer.router, layer.w_gate_up, layer.w_down, m.top_k,
                                  correction_bias=layer.bias, **m.routing)

    def active_experts(self) -> float:
        return sum(ids.unique().numel() for _, ids in self.routes) / len(self.routes)

    def weight_bytes(self) -> int:
        return int(self.active_experts() * self.model.expert_bytes())

    def flops(self) -> int:
        m = self.model
        return 2 * self.tokens * m.top_k * 3 * m.hidden * m.intermediate

    def loop(self):
        """The capturable per-expert loop, over each input's routing fixed ahead of time."""
        plans = []
        for weights, ids in self.routes:
            plan = []
            flat = ids.flatten().long()
            order = flat.argsort(stable=True)
            counts = torch.bincount(flat, minlength=self.model.experts).tolist()  # host side, outside timing
            start = 0
            for expert, count in enumerate(counts):
                pairs = order[start:start + count]
                start += count
                if count:
                    plan.append((expert, pairs // self.model.top_k, weights.flatten()[pairs, None]))
            plans.append(plan)
        inter = self.model.intermediate

        def run(i: int) -> torch.Tensor:
            layer, x = self.layers[i], self.xs[i]
            out = torch.zeros_like(x)
            for expert, tokens, weight in plans[i]:
                gate, up = F.linear(x[tokens], layer.w_gate_up[expert]).split(inter, dim=-1)
                down = F.linear(F.silu(gate) * up, layer.w_down[expert])
                out.index_add_(0, tokens, (down * weight).to(out.dtype))
            return out

        return run

    def grouped_mm(self):
        """torch._grouped_mm for the two expert GEMMs on pre-sorted rows (cumulative int32 offsets)."""
        inputs = []
        for x, (_, ids) in zip(self.xs, self.routes):
            flat = ids.flatten().long()
            order = flat.argsort(stable=True)
            offsets = torch.bincount(flat, minlength=self.model.experts).cumsum(0).int()
            sorted_x = x[order // self.model.top_k].contiguous()
            act = torch.randn(sorted_x.shape[0], self.model.intermediate, device="cuda").bfloat16()
            inputs.append((sorted_x, act, offsets))

        def run(i: int):
            sorted_x, act, offsets = inputs[i]
            layer = self.layers[i]
            torch._grouped_mm(sorted_x, layer.w_gate_up.transpose(1, 2), offs=offsets)
            return torch._grouped_mm(act, layer.w_down.transpose(1, 2), offs=offsets)

        return run


def _eager_seconds(fn) -> float:
    fn(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(0)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def graph_seconds(fn, copies: int) -> float:
    """Graph-replay seconds per call, with enough calls per graph for ~30 ms of replay."""
    calls = int(min(40, max(2 * copies, 0.03 / max(_eager_seconds(fn), 1e-6))))
    return time_graph(fn, copies, calls=calls, replays=3 if calls <= 2 * copies else 5)


def _verify(case: Case, loop) -> float:
    """Relative error of ours against the loop (bf16 cuBLAS) on the first input, before any timing."""
    ours, ref = case.ours(0).float(), loop(0).float()
    err = ((ours - ref).norm() / ref.norm()).item()
    if not math.isfinite(err) or err > 5e-2:
        raise RuntimeError(f"{case.label}: output differs from the per-expert loop (relative error {err:.3g})")
    return err


def _rows_for(case: Case, name: str, copies: int, copy_bw: float) -> tuple[list[dict], dict]:
    m, T = case.model, case.tokens
    label = f"{name} {case.label}"
    act_bytes = 2 * T * m.hidden * BYTES
    weight_bytes = case.weight_bytes()
    layer_bytes = weight_bytes + act_bytes + m.experts * m.hidden * BYTES
    loop = case.loop()
    err = _verify(case, loop)
    times = {"ours": graph_seconds(case.ours, copies)}
    rows = [{"case": label, "impl": "ours", "seconds": times["ours"], "bytes": layer_bytes, "flops": case.flops(),
             "baseline": "weight-stream bound" if T <= 128 else "torch._grouped_mm",
             "verified_rel_err": err, "active_experts": case.active_experts(), "copies": copies}]
    if T <= 128:
        times["bound"] = weight_bytes / copy_bw
        rows.append({"case": label, "impl": "weight-stream bound", "seconds": times["bound"], "bytes": weight_bytes,
                     "flops": 0})
    if T >= 1024:
        pairs = T * m.top_k
        times["grouped"] = graph_seconds(case.grouped_mm(), copies)
        rows.append({"case": label, "impl": "torch._grouped_mm", "seconds": times["grouped"], "flops": case.flops(),
                     "bytes": weight_bytes + pairs * (2 * m.hidden + 3 * m.intermediate) * BYTES})
    if T <= 4096:
        times["loop"] = graph_seconds(loop, copies)
        rows.append({"case": label, "impl": "per-expert loop", "seconds": times["loop"], "bytes": layer_bytes,
                     "flops": case.flops()})
    return rows, times


# ----------------------------------------------------------------------------------------------------
# 4-bit experts: random packed weights (every 32-bit pattern is a valid word of 4-bit codes), the layer's
# router, rotated like the bf16 layers
# ----------------------------------------------------------------------------------------------------


@dataclass
class QuantLayer:
    w_gate_up: object  # QuantizedExperts
    w_down: object
    router: torch.Tensor
    bias: torch.Tensor | None


def random_quantized(k, experts: int, n: int, kdim: int, spec: dict, device="cuda"):
    """QuantizedExperts [E, n, kdim] of random codes whose dequantized values have std ~ kdim^-0.5."""
    q = k.quantized
    group_size, fmt, zero_point = spec["group_size"], spec["fmt"], spec["zero_point"]
    np_, kp = q.round_up(n, q.PAD_N), q.round_up(kdim, q.TILE_K)
    groups = q.num_groups(kdim, group_size)
    words = torch.randint(-2**31, 2**31, (experts, np_, kp // 8), dtype=torch.int32, device=device)
    unit = 1.0 if fmt == "nf4" else 4.6  # std of codebook values / of uniform codes - 8
    scales = (torch.rand(experts, groups, np_, device=device) + 0.5) * (kdim**-0.5 / unit)
    zeros = mins = codebook = None
    if zero_point is True:
        zeros = torch.randint(6, 11, (experts, groups, np_), dtype=torch.uint8, device=device)
    elif zero_point == "float":
        mins = -8 * scales
    if fmt == "nf4":
        codebook = torch.tensor(k.NF4_CODEBOOK, dtype=torch.float32, device=device)
    return k.QuantizedExperts(qweight=words, scales=scales.bfloat16(), shape=(n, kdim), group_size=group_size,
                              fmt=fmt, zeros=zeros, mins=None if mins is None else mins.bfloat16(),
                              codebook=codebook, dtype=torch.bfloat16)


def make_quantized_layers(k, model: Model, copies: int, spec: dict, device="cuda") -> list[QuantLayer]:
    E, H, I = model.experts, model.hidden, model.intermediate
    layers = []
    for _ in range(copies):
        router = torch.empty(E, H, device=device, dtype=torch.bfloat16).normal_(0, H**-0.5)
        bias = torch.randn(E, device=device) * 0.01 if model.routing["scoring"] == "sigmoid" else None
        layers.append(QuantLayer(random_quantized(k, E, 2 * I, H, spec, device),
                                 random_quantized(k, E, H, I, spec, device), router, bias))
    return layers


def quant_expert_bytes(k, model: Model, spec: dict) -> int:
    """Bytes one expert's 4-bit weights take (packed words, scales, zero points or minima)."""
    q = k.quantized
    total = 0
    for n, kdim in ((2 * model.intermediate, model.hidden), (model.hidden, model.intermediate)):
        np_, params = q.round_up(n, q.PAD_N), q.num_groups(kdim, spec["group_size"])
        per_param = BYTES + (1 if spec["zero_point"] is True else BYTES if spec["zero_point"] == "float" else 0)
        total += np_ * q.round_up(kdim, q.TILE_K) // 2 + params * np_ * per_param
    return total


class QuantCase(Case):
    """moe_forward with 4-bit experts at T tokens (routing from each input's router, as moe_forward does)."""

    def __init__(self, k, model: Model, layers: list[QuantLayer], tokens: int, fmt_name: str, expert_bytes: int,
                 seed: int):
        super().__init__(k, model, layers, tokens, skewed=False, seed=seed)
        self.fmt_name, self.q_expert_bytes = fmt_name, expert_bytes

    @property
    def label(self) -> str:
        return f"4bit-{self.fmt_name} T={self.tokens}"

    def weight_bytes(self) -> int:
        return int(self.active_experts() * self.q_expert_bytes)

    def reference(self, i: int) -> torch.Tensor:
        """The per-expert loop (bf16 cuBLAS) on the dequantized selected experts of input i; not timed."""
        layer, x = self.layers[i], self.xs[i]
        weights, ids = self.routes[i]
        inter = self.model.intermediate
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in ids.unique().tolist():
            token, slot = (ids == expert).nonzero(as_tuple=True)
            w_gate_up = self.k.dequantize(layer.w_gate_up.experts(slice(expert, expert + 1)), torch.bfloat16)[0]
            w_down = self.k.dequantize(layer.w_down.experts(slice(expert, expert + 1)), torch.bfloat16)[0]
            gate, up = F.linear(x[token], w_gate_up).split(inter, dim=-1)
            out.index_add_(0, token, F.linear(F.silu(gate) * up, w_down).float() * weights[token, slot, None])
        return out.to(x.dtype)


def _quant_rows_for(case: QuantCase, name: str, copies: int, copy_bw: float) -> tuple[list[dict], dict]:
    m, T = case.model, case.tokens
    label = f"{name} {case.label}"
    weight_bytes = case.weight_bytes()
    layer_bytes = weight_bytes + 2 * T * m.hidden * BYTES + m.experts * m.hidden * BYTES
    ours0, ref = case.ours(0).float(), case.reference(0).float()
    err = ((ours0 - ref).norm() / ref.norm()).item()
    if not math.isfinite(err) or err > 5e-2:
        raise RuntimeError(f"{label}: output differs from the per-expert loop on the dequantized experts "
                           f"(relative error {err:.3g})")
    times = {"ours": graph_seconds(case.ours, copies), "bound": weight_bytes / copy_bw}
    rows = [{"case": label, "impl": "ours", "seconds": times["ours"], "bytes": layer_bytes, "flops": case.flops(),
             "baseline": "weight-stream bound", "verified_rel_err": err, "active_experts": case.active_experts(),
             "copies": copies, "weight_format": case.fmt_name},
            {"case": label, "impl": "weight-stream bound", "seconds": times["bound"], "bytes": weight_bytes,
             "flops": 0}]
    return rows, times


def run_4bit(kernel_module, copy_bw: float | None = None, models: dict[str, Model] | None = None) -> dict:
    """Only the 4-bit rows (a results dict like `run`'s; `run` includes them)."""
    if copy_bw is None:
        torch.manual_seed(0)
        warm_clocks()
        copy_bw = measure_copy_bandwidth()
    rows = []
    for name, model in (models or MODELS).items():
        for fmt_name, spec in QUANT_FORMATS.items():
            expert_bytes = quant_expert_bytes(kernel_module, model, spec)
            copies = rotation_count(model.top_k * expert_bytes, max_copies=QUANT_MAX_COPIES)
            layers = make_quantized_layers(kernel_module, model, copies, spec)
            for i, T in enumerate(QUANT_TOKENS):
                case = QuantCase(kernel_module, model, layers, T, fmt_name, expert_bytes, seed=100 + i)
                case_rows, times = _quant_rows_for(case, name, copies, copy_bw)
                rows += case_rows
                print(f"{name} {case.label}: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in times.items()),
                      flush=True)
                del case
            del layers
            torch.cuda.empty_cache()
    return {"kernel": "moe-dispatch", "env": environment(), "copy_bandwidth": copy_bw, "rows": rows, "notes": NOTES}


def _quant_goals(by_case: dict[str, dict]) -> list[dict]:
    out = []
    for case, impls in by_case.items():
        name, label = case.split(" ", 1)
        if not label.startswith("4bit-"):
            continue
        tokens = int(label.split("T=")[1])
        ours = impls["ours"]["seconds"]
        bf16 = by_case.get(f"{name} T={tokens}", {}).get("ours")
        if tokens >= 4096:
            if bf16 is not None:
                ratio = bf16["seconds"] / ours
                out.append({"goal": "4-bit T>=4096: bf16 time / 4-bit time", "case": case, "value": ratio,
                            "target": QUANT_LARGE_GOAL, "met": ratio >= QUANT_LARGE_GOAL})
            continue
        if tokens > 1:  # the issue: T = 8-512 faster than the bf16 path
            if bf16 is not None:
                out.append({"goal": "4-bit T=8-512: bf16 time / 4-bit time", "case": case,
                            "value": bf16["seconds"] / ours, "target": 1.0, "met": bf16["seconds"] >= ours})
            continue
        ratio = ours / impls["weight-stream bound"]["seconds"]
        out.append({"goal": "4-bit T=1 time / 4-bit weight-stream bound", "case": case, "value": ratio,
                    "target": QUANT_BOUND_GOAL, "met": ratio <= QUANT_BOUND_GOAL, "at_most": True})
        if bf16 is not None:
            speedup = bf16["seconds"] / ours
            out.append({"goal": "4-bit T=1: bf16 time / 4-bit time", "case": case, "value": speedup,
                        "target": QUANT_SPEEDUP_GOAL, "met": speedup >= QUANT_SPEEDUP_GOAL})
    return out


def goals(results: dict) -> list[dict]:
    """The issue's goals, evaluated on the measured rows."""
    if results.get("mode") == "expert-parallel":
        return ep_goals(results)
    by_case: dict[str, dict] = {}
    for r in results["rows"]:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    out = []
    for case, impls in by_case.items():
        name, label = case.split(" ", 1)
        if label.startswith("4bit-"):
            continue
        tokens, skewed = int(label.split("T=")[1]), label.startswith("skewed")
        ours = impls["ours"]["seconds"]
        if tokens == 1:
            ratio = ours / impls["weight-stream bound"]["seconds"]
            out.append({"goal": "T=1 time / weight-stream bound", "case": case, "value": ratio,
                        "target": GOALS[name], "met": ratio <= GOALS[name], "at_most": True})
        if "torch._grouped_mm" in impls and tokens >= 4096 and not skewed:
            ratio = impls["torch._grouped_mm"]["seconds"] / ours
            out.append({"goal": "TFLOP/s / torch._grouped_mm TFLOP/s", "case": case, "value": ratio,
                        "target": GROUPED_MM_GOAL, "met": ratio >= GROUPED_MM_GOAL})
        if "per-expert loop" in impls:
            ratio = impls["per-expert loop"]["seconds"] / ours
            out.append({"goal": "per-expert loop time / ours", "case": case, "value": ratio,
                        "target": LOOP_GOAL, "met": ratio >= LOOP_GOAL})
    return out + _quant_goals(by_case)


NOTES = [
    "Baselines: `weight-stream bound` = bytes of the experts the routing selects / copy bandwidth (a read-only "
    "stream can beat the read+write copy figure slightly); `torch._grouped_mm` = only the two expert GEMMs on "
    "pre-sorted rows; `per-expert loop` = transformers' eager experts loop made capturable (routing computed "
    "ahead, static per-expert index tensors, no host sync, graph-replayed). `ours` times the whole layer "
    "(`moe_forward`: router GEMM, routing, sort, both expert GEMMs, combine); skewed cases time `fused_experts` "
    "on Zipf-distributed ids.",
    "4-bit rows (`<model> 4bit-<format> T=<tokens>`): moe_forward with QuantizedExperts of random codes (int4 g128 "
    "symmetric: packed words + bf16 scales), bound = bytes of the selected experts' packed words and scales / copy "
    "bandwidth; checked against the per-expert loop on the dequantized experts before timing.",
]


def _cases(k, name: str, model: Model, layers: list[Layer]):
    for i, T in enumerate(model.tokens):
        yield Case(k, model, layers, T, skewed=False, seed=i)
    yield Case(k, model, layers, SKEWED_TOKENS, skewed=True, seed=99)


def run(kernel_module) -> dict:
    torch.manual_seed(0)
    warm_clocks()
    copy_bw = measure_copy_bandwidth()
    matmul_flops = measure_matmul_flops()
    rows = []
    for name, model in MODELS.items():
        copies = max(2, min(3, rotation_count(model.top_k * model.expert_bytes())))
        layers = make_layers(model, copies)
        for case in _cases(kernel_module, name, model, layers):
            case_rows, times = _rows_for(case, name, copies, copy_bw)
            rows += case_rows
            print(f"{name} {case.label}: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in times.items()), flush=True)
            del case
        del layers
        torch.cuda.empty_cache()
    rows += run_4bit(kernel_module, copy_bw)["rows"]
    return {"kernel": "moe-dispatch", "env": environment(), "copy_bandwidth": copy_bw, "matmul_flops": matmul_flops,
            "rows": rows, "notes": NOTES}


# ----------------------------------------------------------------------------------------------------
# Expert parallelism: `python scripts/bench.py moe-dispatch --ep` (one process per GPU, NCCL)
# ----------------------------------------------------------------------------------------------------
#
# Each rank holds E / W experts and its own T tokens (T is per rank: a decode step of T sequences on every
# rank, or a prefill chunk of T tokens on every rank). Per (model, W, T), measured on every rank and
# reported as the slowest rank's time:
#   ours (EP, capacity=T)   moe_forward with ExpertParallel(capacity=T): never drops (a token goes at most
#                           once to a rank), no host sync, CUDA-graph replay like the single-GPU benchmark
#   ours (EP, variable)     moe_forward with ExpertParallel(): counts exchanged, one host sync per call,
#                           so eager (event timing, host sync included); T >= EP_VARIABLE_FROM only
#   all-to-all (<mode>)     the same collectives alone, on buffers of the sizes that mode sends for these inputs
#   single GPU              moe_forward on one GPU with all E experts on all W * T tokens (rank 0)
#   single GPU / W + all-to-all (<mode>)   the reference: perfect scaling plus the exchange
#   torch._grouped_mm (local experts)      only the two expert GEMMs on the pairs this rank receives
# Outputs are checked on every rank against the single-GPU kernel on that rank's tokens before timing.

EP_MODELS = ("mixtral-8x7b", "deepseek-v3")
EP_TOKENS = (1, 64, 4096)
EP_WORLD_SIZES = (2, 4, 8)
EP_VARIABLE_FROM = 1024  # the variable (prefill) mode is timed from this many tokens per rank
EP_GOAL = 1.3  # DeepSeek-V3, T = 4096, variable mode: EP time / (single GPU / W + all-to-all), at most
EP_GOAL_TOKENS = 4096
EP_COPIES = 2  # rotated inputs (each call streams its experts' weights, far more than L2, at every T here)
EP_RESULTS_NAME = "moe-dispatch-ep"  # docs/benchmarks/moe-dispatch-ep-results.json


def ep_world_sizes(spec: str, gpus: int, models: dict[str, Model] | None = None) -> list[int]:
    """The world sizes `--ep SPEC` runs ("auto": 2, 4, 8 as far as the host has GPUs; or e.g. "2,4") on a
    host with `gpus` CUDA GPUs; ValueError, saying why, when it cannot run."""
    if gpus < 2:
        raise ValueError(f"moe-dispatch --ep runs one process per GPU over NCCL and needs at least 2 CUDA GPUs "
                         f"on this host; found {gpus}")
    if spec == "auto":
        sizes = [w for w in EP_WORLD_SIZES if w <= gpus]
    else:
        try:
            sizes = sorted({int(part) for part in spec.split(",")})
        except ValueError:
            raise ValueError(f"--ep takes 'auto' or world sizes such as 2,4; got {spec!r}") from None
        bad = [w for w in sizes if not 2 <= w <= gpus]
        if bad:
            raise ValueError(f"--ep world sizes must lie in [2, {gpus}] (the GPUs on this host); got {bad}")
    models = models if models is not None else {name: MODELS[name] for name in EP_MODELS}
    for w in sizes:
        uneven = [name for name, m in models.items() if m.experts % w]
        if uneven:
            raise ValueError(f"--ep world size {w} does not divide the experts of {', '.join(uneven)}")
    return sizes


class _Clock:
    """Seconds per call, the same number of calls on every rank (their collectives must pair up), reported
    as the slowest rank's. CUDA: graph replay or events; CPU (the test's smoke run): perf_counter."""

    def __init__(self, device: torch.device, group):
        self.device, self.group = device, group
        self.cuda = device.type == "cuda"

    def slowest(self, seconds: float) -> float:
        import torch.distributed as dist

        t = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def graph(self, fn, copies: int) -> float:
        """CUDA-graph replay of `fn(i)` over the rotated inputs (as the single-GPU benchmark)."""
        if not self.cuda:
            return self.eager(fn, copies)
        estimate = self.slowest(_eager_seconds(fn))
        calls = int(min(40, max(2 * copies, 0.03 / max(estimate, 1e-6))))
        return self.slowest(time_graph(fn, copies, calls=calls, replays=3 if calls <= 2 * copies else 5))

    def eager(self, fn, copies: int, iters: int = 5, repeats: int = 3) -> float:
        import time

        import torch.distributed as dist

        if not self.cuda:  # the smoke run checks the code, not the numbers
            iters, repeats = 1, 1
        for i in range(copies):
            fn(i)
        self._sync()
        dist.barrier(group=self.group)
        best = float("inf")
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for i in range(iters):
                    fn(i % copies)
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3 / iters)
            else:
                start = time.perf_counter()
                for i in range(iters):
                    fn(i % copies)
                best = min(best, (time.perf_counter() - start) / iters)
        return self.slowest(best)

    def alone(self, fn, copies: int) -> float:
        """`fn` on this rank only (no collectives inside): graph replay on CUDA."""
        if not self.cuda:
            import time

            fn(0)
            start = time.perf_counter()
            for i in range(2 * copies):
                fn(i % copies)
            return (time.perf_counter() - start) / (2 * copies)
        return graph_seconds(fn, copies)


def _ep_a2a(ep, send_sizes: list[int], recv_sizes: list[int], width: int, hidden: int, device: torch.device):
    """The collectives of one EP layer call on buffers of its sizes: (counts), dispatch, combine."""
    import torch.distributed as dist

    send = torch.zeros(int(sum(send_sizes)), width, dtype=torch.bfloat16, device=device)
    recv = torch.empty(int(sum(recv_sizes)), width, dtype=torch.bfloat16, device=device)
    back_in = torch.zeros(recv.shape[0], hidden, dtype=torch.bfloat16, device=device)
    back_out = torch.empty(send.shape[0], hidden, dtype=torch.bfloat16, device=device)
    counts = torch.zeros(ep.world_size, dtype=torch.int64, device=device)
    counts_in = torch.empty_like(counts)
    variable = ep.capacity is None

    def run():
        if variable:
            dist.all_to_all_single(counts_in, counts, group=ep.group)
            counts_in.tolist()  # the host sync the variable mode makes
        dist.all_to_all_single(recv, send, recv_sizes if variable else None, send_sizes if variable else None,
                               group=ep.group)
        dist.all_to_all_single(back_out, back_in, send_sizes if variable else None,
                               recv_sizes if variable else None, group=ep.group)

    return run, (send.numel() + recv.numel() + back_in.numel() + back_out.numel()) * BYTES


def _ep_case_rows(k, clock: _Clock, ep_group, name: str, model: Model, layer: Layer, tokens: int,
                  variable_from: int = EP_VARIABLE_FROM) -> list[dict]:
    import torch.distributed as dist

    device = clock.device
    world, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    E, H, I, top_k = model.experts, model.hidden, model.intermediate, model.top_k
    n_local = E // world
    g = torch.Generator(device=device).manual_seed(1000 * world + tokens)  # same on every rank
    xs_all = [torch.randn(world * tokens, H, device=device, generator=g).bfloat16() for _ in range(EP_COPIES)]
    xs = [x[rank * tokens:(rank + 1) * tokens] for x in xs_all]
    routes = [k.route(F.linear(x, layer.router), top_k, correction_bias=layer.bias, **model.routing) for x in xs_all]
    probe = k.ExpertParallel(ep_group)
    w_gate_up, w_down = probe.shard(layer.w_gate_up), probe.shard(layer.w_down)
    label = f"{name} W={world} T={tokens}"
    flops_rank = 2 * tokens * top_k * 3 * H * I  # this rank's tokens' share of the work (balanced on average)
    local = slice(rank * n_local, (rank + 1) * n_local)

    def single(i):
        return k.moe_forward(xs_all[i], layer.router, layer.w_gate_up, layer.w_down, top_k,
                             correction_bias=layer.bias, **model.routing)

    # the baselines that need no exchange
    t_single = clock.slowest(clock.alone(single, EP_COPIES) if rank == 0 else 0.0)
    dist.barrier(group=ep_group)
    gmm_inputs, local_bytes = [], 0
    for x_all, (_, ids) in zip(xs_all, routes):
        flat = ids.flatten().long()
        mine = ((flat >= local.start) & (flat < local.stop)).nonzero().squeeze(1)
        experts = flat[mine] - local.start
        order = experts.argsort(stable=True)
        counts = torch.bincount(experts, minlength=n_local)
        offsets = counts.cumsum(0).int()
        sorted_x = x_all[mine[order] // top_k].contiguous()
        act = torch.randn(sorted_x.shape[0], I, device=device).bfloat16()
        gmm_inputs.append((sorted_x, act, offsets))
        local_bytes = max(local_bytes, int((counts > 0).sum()) * model.expert_bytes())

    def grouped(i):
        sorted_x, act, offsets = gmm_inputs[i]
        if sorted_x.shape[0] == 0:  # none of this rank's experts picked (small T): nothing to multiply
            return None
        torch._grouped_mm(sorted_x, w_gate_up.transpose(1, 2), offs=offsets)
        return torch._grouped_mm(act, w_down.transpose(1, 2), offs=offsets)

    t_grouped = clock.slowest(clock.alone(grouped, EP_COPIES))
    pairs_local = max(int(offsets[-1]) if offsets.numel() else 0 for _, _, offsets in gmm_inputs)
    layer_bytes = int(clock.slowest(local_bytes)) + 2 * tokens * H * BYTES
    rows = [
        {"case": label, "impl": "single GPU", "seconds": t_single, "world_size": world, "tokens_per_rank": tokens,
         "bytes": int(sum(ids.unique().numel() for _, ids in routes) / len(routes)) * model.expert_bytes(),
         "flops": world * flops_rank},
        {"case": label, "impl": "torch._grouped_mm (local experts)", "seconds": t_grouped, "world_size": world,
         "tokens_per_rank": tokens, "bytes": layer_bytes, "flops": 2 * pairs_local * 3 * H * I},
    ]

    modes = [("capacity", max(tokens, 1), "graph")] + ([("variable", None, "eager")] if tokens >= variable_from else [])
    width = H + 8 * top_k // BYTES  # parallel.py's rows: activations, then int32 ids and fp32 weights as bf16
    for mode, capacity, timing in modes:
        ep = k.ExpertParallel(ep_group, capacity=capacity)

        def ours(i, ep=ep):
            return k.moe_forward(xs[i], layer.router, w_gate_up, w_down, top_k, correction_bias=layer.bias,
                                 expert_parallel=ep, **model.routing)

        out = ours(0).float()
        ref = k.moe_forward(xs[0], layer.router, layer.w_gate_up, layer.w_down, top_k, correction_bias=layer.bias,
                            **model.routing).float()  # the single-GPU kernel on this rank's tokens
        err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item() if tokens else 0.0
        err = clock.slowest(err if math.isfinite(err) else float("inf"))
        if err > 5e-2:
            raise RuntimeError(f"{label} {mode}: EP output differs from the single-GPU kernel "
                               f"(relative error {err:.3g})")
        t_ours = clock.graph(ours, EP_COPIES) if timing == "graph" else clock.eager(ours, EP_COPIES)
        dropped = int(clock.slowest(ep.dropped_count()))

        # the same exchange alone, sized from input 0's routing
        need = k.parallel.destinations(routes[0][1][rank * tokens:(rank + 1) * tokens], n_local, world).any(dim=1)
        if capacity is None:
            counts = need.sum(dim=0)
            counts_in = torch.empty_like(counts)
            dist.all_to_all_single(counts_in, counts, group=ep_group)
            send_sizes, recv_sizes = counts.tolist(), counts_in.tolist()
        else:
            send_sizes = recv_sizes = [capacity] * world
        a2a, a2a_bytes = _ep_a2a(ep, send_sizes, recv_sizes, width, H, device)
        t_a2a = clock.graph(lambda i: a2a(), EP_COPIES) if timing == "graph" else clock.eager(lambda i: a2a(), 1)
        ideal = f"single GPU / W + all-to-all ({mode})"
        rows += [
            {"case": label, "impl": f"ours (EP, {mode})", "seconds": t_ours, "bytes": layer_bytes + a2a_bytes,
             "flops": flops_rank, "baseline": ideal, "verified_rel_err": err, "dropped": dropped,
             "world_size": world, "tokens_per_rank": tokens, "timing": timing},
            {"case": label, "impl": f"all-to-all ({mode})", "seconds": t_a2a, "bytes": a2a_bytes,
             "world_size": world, "tokens_per_rank": tokens, "timing": timing},
            {"case": label, "impl": ideal, "seconds": t_single / world + t_a2a, "bytes": layer_bytes + a2a_bytes,
             "flops": flops_rank, "world_size": world, "tokens_per_rank": tokens},
        ]
    return rows


def _ep_ceilings(device: torch.device) -> tuple[float, float]:
    """Copy bandwidth and matmul FLOP/s of one device (rank 0's), measured in the run."""
    if device.type == "cuda":
        return measure_copy_bandwidth(), measure_matmul_flops()
    import time

    src = torch.ones(2**22)
    dst = torch.empty_like(src)
    start = time.perf_counter()
    dst.copy_(src)
    copy = 2 * src.numel() * 4 / max(time.perf_counter() - start, 1e-9)
    a = torch.randn(256, 256)
    start = time.perf_counter()
    a @ a
    return copy, 2 * 256**3 / max(time.perf_counter() - start, 1e-9)


def _ep_worker(rank: int, world: int, built: str, store: str, device_type: str, models: dict[str, Model],
               tokens: tuple[int, ...], variable_from: int, out: str) -> None:
    """One rank: NCCL on cuda:rank (gloo on CPU), the kernel loaded from the build folder, every case."""
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    from ..build import load_build

    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # the smoke run: the PyTorch path of the kernel (the torch-cpu variant's), one thread per rank
        os.environ["TRITON_INTERPRET"] = "0"
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            device_id=device if cuda else None)
    try:
        k = load_build(Path(built))
        ceilings = _ep_ceilings(device) if rank == 0 else None
        if cuda:
            warm_clocks()
        clock = _Clock(device, dist.group.WORLD)
        rows = []
        for name, model in models.items():
            torch.manual_seed(0)  # here: rank 0 alone drew random numbers for the ceilings
            layer = make_layers(model, 1, device)[0]  # the same full layer on every rank
            for T in tokens:
                case_rows = _ep_case_rows(k, clock, dist.group.WORLD, name, model, layer, T, variable_from)
                rows += case_rows
                if rank == 0:
                    print(f"{name} W={world} T={T}: " + ", ".join(f"{r['impl']} {r['seconds'] * 1e6:.1f} us"
                                                                for r in case_rows), flush=True)
            del layer
            if cuda:
                torch.cuda.empty_cache()
        if rank == 0:
            Path(out).write_text(json.dumps({"rows": rows, "ceilings": ceilings}))
    finally:
        dist.destroy_process_group()


def run_ep(built, world_sizes: list[int], *, models: dict[str, Model] | None = None,
           tokens: tuple[int, ...] = EP_TOKENS, variable_from: int = EP_VARIABLE_FROM, device_type: str = "cuda",
           timeout: float = 3600, progress=None) -> dict:
    """Every world size in turn: W processes (forkserver, so none inherits a CUDA context), one per GPU,
    each loading the kernel from `built` (a `build_kernel` folder). Returns the results dict; `progress`, if
    given, gets the results so far after each world size (so a run stopped later keeps them).
    device_type="cpu" runs the same code with gloo on CPU processes (the tests' smoke run)."""
    import json
    import multiprocessing
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    models = models if models is not None else {name: MODELS[name] for name in EP_MODELS}
    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "kernels"])  # imports each rank needs
    rows, ceilings, done = [], None, []
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in world_sizes:
            store, out = Path(tmp) / f"store-{world}", Path(tmp) / f"rows-{world}.json"
            context = mp.start_processes(_ep_worker, args=(world, str(built), str(store), device_type, models,
                                                           tuple(tokens), variable_from, str(out)),
                                         nprocs=world, join=False, start_method="forkserver")
            _join(context, timeout)
            part = json.loads(out.read_text())
            rows += part["rows"]
            ceilings = ceilings or part["ceilings"]
            done.append(world)
            results = {"kernel": "moe-dispatch", "mode": "expert-parallel",
                       "env": environment(device="cuda" if device_type == "cuda" else "cpu"),
                       "nccl": str(torch.cuda.nccl.version()) if device_type == "cuda" else None,
                       "world_sizes": list(done), "copy_bandwidth": ceilings[0], "matmul_flops": ceilings[1],
                       "rows": list(rows), "notes": EP_NOTES}
            if progress is not None:
                progress(results)
    return results


def merge_ep_results(old: dict | None, new: dict) -> dict:
    """`new` plus the rows of `old` (an earlier --ep results file) at world sizes `new` did not run, so runs
    on hosts of different sizes (e.g. --ep 2 on one, --ep 4 on another) make one file; each world size keeps
    the environment it was measured in (`env_by_world_size`)."""
    envs = {str(w): new["env"] for w in new["world_sizes"]}
    if not old or old.get("mode") != "expert-parallel":
        return {**new, "env_by_world_size": envs}
    kept = [r for r in old["rows"] if r["world_size"] not in new["world_sizes"]]
    old_envs = old.get("env_by_world_size", {str(w): old["env"] for w in old.get("world_sizes", [])})
    envs = {**{w: e for w, e in old_envs.items() if int(w) not in new["world_sizes"]}, **envs}
    sizes = sorted({r["world_size"] for r in kept} | set(new["world_sizes"]))
    return {**new, "world_sizes": sizes, "rows": kept + new["rows"], "env_by_world_size": envs}


def _join(context, timeout: float) -> None:
    """Wait for every rank; past `timeout` (a rank stuck in a collective) end the ranks started here."""
    import time

    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(1.0, min(10.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"expert-parallel benchmark ranks still running after {timeout:.0f} s")


def ep_goals(results: dict) -> list[dict]:
    """DeepSeek-V3 at T = 4096 per rank, variable (prefill) mode: EP time / (single GPU / W + all-to-all)."""
    by_case: dict[str, dict] = {}
    for r in results["rows"]:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    out = []
    for case, impls in by_case.items():
        ours, ideal = impls.get("ours (EP, variable)"), impls.get("single GPU / W + all-to-all (variable)")
        if case.startswith("deepseek-v3 ") and ours and ideal and ours["tokens_per_rank"] == EP_GOAL_TOKENS:
            ratio = ours["seconds"] / ideal["seconds"]
            out.append({"goal": "EP time / (single GPU / W + all-to-all)", "case": case, "value": ratio,
                        "target": EP_GOAL, "met": ratio <= EP_GOAL, "at_most": True})
    return out


EP_NOTES = [
    "Expert parallelism (`python scripts/bench.py moe-dispatch --ep`): W processes, one per GPU, NCCL; each rank "
    "holds E / W experts and its own T tokens (T is per rank). `ours (EP, capacity=T)` is moe_forward with "
    "ExpertParallel(capacity=T) (never drops, no host sync) timed by CUDA-graph replay; `ours (EP, variable)` "
    "exchanges counts first (one host sync per call) and is timed eagerly with events; `all-to-all` times the "
    "same collectives alone on buffers of that mode's sizes; `single GPU` is moe_forward with all experts on one "
    "GPU over all W * T tokens; `single GPU / W + all-to-all` is the issue's reference; `torch._grouped_mm` times "
    "only the two expert GEMMs on the pairs a rank receives. Each time is the slowest rank's.",
]
