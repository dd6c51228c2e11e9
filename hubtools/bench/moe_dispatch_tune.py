"""Measure block-size candidates on a GPU and write the tuned configs the package ships.

    python -m hubtools.bench.moe_dispatch_tune BUILD_DIR --out DIR [--compile-only --shard I/N]
    python -m hubtools.bench.moe_dispatch_tune BUILD_DIR --out DIR --gemv-4bit 1 4 [--models ...] [--candidates ...]
    python -m hubtools.bench.moe_dispatch_tune BUILD_DIR --out DIR --dot-4bit 16 128 4096 [--models ...]
    python -m hubtools.bench.moe_dispatch_tune BUILD_DIR --configs-from docs/benchmarks/moe-dispatch-tune.json \
        --device "NVIDIA H200" --out moe-dispatch/torch-ext/moe_dispatch

BUILD_DIR is a built kernel (`scripts/publish.py --build-only --out X moe-dispatch` -> X/moe-dispatch/build).
`--compile-only` runs shard I of N of the candidate calls once, to fill Triton's disk cache from several
processes at a time; the timing run then finds every kernel compiled. Timing follows
hubtools/measure.py (CUDA-graph replay, two rotated copies of the layer so weights stream from
HBM). Writes DIR/tune-results.json (every measurement) and DIR/configs/E=..,H=..,I=..,dtype=bfloat16,device=<gpu>.json
(the fastest config per token count, with the command and versions of the run); `--configs-from` redoes that
last step from a saved results file, for the GPU named by --device.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .moe_dispatch import MODELS, Model, graph_seconds, make_layers
from ..measure import environment, warm_clocks

COPIES = 2  # rotated layer copies per timed problem

DECODE = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages) for either decode kernel
    (16, 256, 4, 4), (32, 256, 4, 4), (64, 256, 4, 3), (16, 512, 4, 3), (32, 128, 4, 6), (64, 128, 4, 4),
]


# T = 1 stream kernels (`launch._streams`): name -> (programs per SM, (BLOCK_N, BLOCK_K, num_warps, num_stages) of
# both GEMVs); timed after the decode kernels' search, a table's T = 1 entry takes the fastest of either
STREAM = {"s2-16x256": (2, (16, 256, 4, 4)), "s4-16x256": (4, (16, 256, 4, 4)), "s2-32x128": (2, (32, 128, 4, 4)),
          "s3-16x128": (3, (16, 128, 4, 6)), "s2-8x512": (2, (8, 512, 4, 3))}


def stream_config(name: str) -> dict:
    programs, plan = STREAM[name]
    return {"STREAM": programs, **decode_config(plan, plan)}


def _gemm(n, k, group, warps, stages):
    return {"BLOCK_N": n, "BLOCK_K": k, "GROUP_M": group, "num_warps": warps, "num_stages": stages}


GROUPED = {  # name: BLOCK_M, gate_up, down
    "m128_n128": (128, _gemm(128, 64, 8, 8, 3), _gemm(128, 64, 8, 8, 4)),
    "m128_n256": (128, _gemm(128, 64, 8, 8, 4), _gemm(256, 64, 8, 8, 3)),
    "m128_n64": (128, _gemm(64, 64, 8, 4, 4), _gemm(128, 64, 8, 4, 4)),
    "m64_n128": (64, _gemm(128, 64, 8, 4, 4), _gemm(128, 64, 8, 4, 4)),
    "m64_n64": (64, _gemm(64, 64, 8, 4, 5), _gemm(64, 128, 8, 4, 4)),
    "m32_n64": (32, _gemm(64, 64, 8, 4, 4), _gemm(64, 64, 8, 4, 4)),
    "m16_n64": (16, _gemm(64, 128, 8, 4, 4), _gemm(64, 128, 8, 4, 4)),
    "m16_n32": (16, _gemm(32, 128, 8, 4, 5), _gemm(32, 256, 8, 4, 4)),
}


def grouped_candidates(tokens: int) -> list[str]:
    if tokens <= 128:
        return ["m64_n128", "m64_n64", "m32_n64", "m16_n64", "m16_n32"]
    if tokens <= 1024:
        return ["m128_n128", "m128_n256", "m128_n64", "m64_n128", "m64_n64", "m32_n64"]
    return ["m128_n128", "m128_n256", "m128_n64", "m64_n128", "m64_n64"]


def decode_config(gate_up, down) -> dict:
    def one(c):
        return {"BLOCK_N": c[0], "BLOCK_K": c[1], "num_warps": c[2], "num_stages": c[3]}

    return {"gate_up": one(gate_up), "down": one(down)}


def grouped_config(name: str) -> dict:
    block_m, gate_up, down = GROUPED[name]
    return {"BLOCK_M": block_m, "gate_up": gate_up, "down": down}


class Problem:
    """Rotated layer copies and uniformly routed inputs (distinct experts per token) for one (model, T)."""

    def __init__(self, tk, model: Model, tokens: int, copies: int):
        self.tk = tk
        torch.manual_seed(tokens)
        self.layers = make_layers(model, copies)
        g = torch.Generator(device="cuda").manual_seed(tokens)
        self.inputs = []
        for _ in range(copies):
            x = torch.randn(tokens, model.hidden, device="cuda", generator=g).bfloat16()
            ids = torch.rand(tokens, model.experts, device="cuda", generator=g).argsort(1)[:, :model.top_k].int()
            weights = torch.rand(tokens, model.top_k, device="cuda", generator=g)
            self.inputs.append((x, weights / weights.sum(1, keepdim=True), ids, torch.empty_like(x)))

    def call(self, config):
        def fn(i):
            x, weights, ids, out = self.inputs[i]
            layer = self.layers[i]
            return self.tk.experts(x, layer.w_gate_up, layer.w_down, weights, ids, out, config=config)

        return fn


def jobs(tk, names):
    """(model, T, label, config) for every candidate; decode down candidates use the default gate_up."""
    for name in names:
        m = MODELS[name]
        for T in m.tokens:
            if T <= tk.DECODE_MAX_TOKENS:
                base = tk.default_config(T, m.experts, m.hidden, m.intermediate, m.top_k, torch.device("cuda"))
                for c in DECODE:
                    yield name, T, f"gate_up{c}", {**base, "gate_up": decode_config(c, c)["gate_up"]}
                    yield name, T, f"down{c}", {**base, "down": decode_config(c, c)["down"]}
                if T == 1:
                    for cand in STREAM:
                        yield name, T, cand, stream_config(cand)
            else:
                for cand in grouped_candidates(T):
                    yield name, T, cand, grouped_config(cand)


def compile_shard(tk, names, shard: int, shards: int) -> None:
    problems = {}
    for i, (name, T, _, config) in enumerate(jobs(tk, names)):
        if i % shards != shard:
            continue
        if (name, T) not in problems:
            problems.clear()
            torch.cuda.empty_cache()
            problems[(name, T)] = Problem(tk, MODELS[name], T, 1)
        problems[(name, T)].call(config)(0)
    torch.cuda.synchronize()


def tune(tk, names) -> list[dict]:
    """Every candidate's time; decode kernels one at a time, the other at its best so far."""
    warm_clocks()
    results = []
    for name in names:
        m = MODELS[name]
        for T in m.tokens:
            problem = Problem(tk, m, T, COPIES)
            if T <= tk.DECODE_MAX_TOKENS:
                config = tk.default_config(T, m.experts, m.hidden, m.intermediate, m.top_k, torch.device("cuda"))
                for kernel in ("gate_up", "down"):
                    timed = []
                    for c in DECODE:
                        trial = {**config, kernel: decode_config(c, c)[kernel]}
                        timed.append((graph_seconds(problem.call(trial), COPIES), trial))
                        results.append({"model": name, "T": T, "kernel": kernel, "candidate": list(c),
                                        "seconds": timed[-1][0]})
                    config = min(timed, key=lambda tc: tc[0])[1]
                if T == 1:
                    for cand in STREAM:
                        results.append({"model": name, "T": T, "kernel": "stream", "candidate": cand,
                                        "seconds": graph_seconds(problem.call(stream_config(cand)), COPIES)})
            else:
                for cand in grouped_candidates(T):
                    results.append({"model": name, "T": T, "candidate": cand,
                                    "seconds": graph_seconds(problem.call(grouped_config(cand)), COPIES)})
            print(name, T, f"{min(r['seconds'] for r in results if (r['model'], r['T']) == (name, T)) * 1e6:.1f} us",
                  flush=True)
            del problem
            torch.cuda.empty_cache()
    return results


def _packed(n, tiles, warps, stages, bcast=True, tma=True, split=1, pdl=True) -> dict:
    plan = {"BLOCK_N": n, "BLOCK_K": 128, "TILES": tiles, "num_warps": warps, "num_stages": stages, "X_BCAST": bcast,
            "TMA": tma, "PDL": pdl}
    return {**plan, "SPLIT_K": split} if split > 1 else plan


PACKED = {  # 4-bit experts' packed-fp16 GEMV candidates (either kernel; SPLIT_K only for the down GEMV)
    "16x8-tma3-w2": _packed(16, 8, 2, 3), "16x8-tma3-w2-nopdl": _packed(16, 8, 2, 3, pdl=False),
    "16x8-tma3-w4": _packed(16, 8, 4, 3), "16x4-tma4-w2": _packed(16, 4, 2, 4),
    "8x8-tma3-w2": _packed(8, 8, 2, 3), "32x4-tma3-w4": _packed(32, 4, 4, 3), "16x8-tma2-w2": _packed(16, 8, 2, 2),
    "16x8-cp3-w2": _packed(16, 8, 2, 3, tma=False), "8x8-plain-w4": _packed(8, 8, 4, 1, bcast=False, tma=False),
    "16x8-tma3-w2-split2": _packed(16, 8, 2, 3, split=2),
}


def _dot_plan(n, warps, stages, packed=True, swap=True) -> dict:
    return {"BLOCK_N": n, "BLOCK_K": 128, "num_warps": warps, "num_stages": stages, "PACKED": packed,
            "SWAP_AB": swap}


def _dot_config(block_m, gate_up, down) -> dict:
    """A config of the tl.dot expert kernels (BLOCK_M None: the decode kernels, T <= DECODE_MAX_TOKENS)."""
    config = {"gate_up": gate_up, "down": down}
    if block_m is not None:
        config["BLOCK_M"] = block_m
        for key in ("gate_up", "down"):
            config[key] = {**config[key], "GROUP_M": 8}
    return config


DOT_4BIT = {  # 4-bit experts' tl.dot candidates: name -> (BLOCK_M or None for the decode kernels, gate_up, down)
    "m16-n64-w4-s3": (16, _dot_plan(64, 4, 3), _dot_plan(64, 4, 3)),
    "m16-n128-w4-s3": (16, _dot_plan(128, 4, 3), _dot_plan(128, 4, 3)),
    "m32-n64-w4-s3": (32, _dot_plan(64, 4, 3), _dot_plan(64, 4, 3)),
    "m64-n64-w4-s3": (64, _dot_plan(64, 4, 3), _dot_plan(64, 4, 3)),
    "m64-n128-w4-s3": (64, _dot_plan(128, 4, 3), _dot_plan(128, 4, 3)),
    "m64-n128-w8-s3": (64, _dot_plan(128, 8, 3), _dot_plan(128, 8, 3)),
    "m128-n64-w4-s3": (128, _dot_plan(64, 4, 3), _dot_plan(64, 4, 3)),
    "m128-n128-w8-s3": (128, _dot_plan(128, 8, 3), _dot_plan(128, 8, 3)),
    "m128-n64-w8-s4": (128, _dot_plan(64, 8, 4), _dot_plan(64, 8, 4)),
    "m32-n128-w8-s3": (32, _dot_plan(128, 8, 3), _dot_plan(128, 8, 3)),
    "m64-gu64w4s4-dn64w4s4": (64, _dot_plan(64, 4, 4), _dot_plan(64, 4, 4)),
    "m64-gu64w4s3-dn128w8s3": (64, _dot_plan(64, 4, 3), _dot_plan(128, 8, 3)),
    "m64-gu64w4s3-dn128w4s3": (64, _dot_plan(64, 4, 3), _dot_plan(128, 4, 3)),
    "m64-gu64w4s3-dn256w8s3": (64, _dot_plan(64, 4, 3), _dot_plan(256, 8, 3)),
    "m64-gu64w4s2-dn64w4s3": (64, _dot_plan(64, 4, 2), _dot_plan(64, 4, 3)),
    "m128-gu64w4s3-dn128w8s3": (128, _dot_plan(64, 4, 3), _dot_plan(128, 8, 3)),
    "dec-n64-w4-s3": (None, _dot_plan(64, 4, 3), _dot_plan(64, 4, 3)),
    "dec-n128-w8-s3": (None, _dot_plan(128, 8, 3), _dot_plan(128, 8, 3)),
    "dec-n32-w4-s3": (None, _dot_plan(32, 4, 3), _dot_plan(32, 4, 3)),
    "dec-n128-w4-s3": (None, _dot_plan(128, 4, 3), _dot_plan(128, 4, 3)),
    "dec-n64-w4-s4": (None, _dot_plan(64, 4, 4), _dot_plan(64, 4, 4)),
    "dec-n64-w4-s3-noswap": (None, _dot_plan(64, 4, 3, swap=False), _dot_plan(64, 4, 3, swap=False)),
}


# 4-bit experts' Gluon grouped kernel (`launch._grouped_wgmma`, Hopper): name -> whole config
WGMMA_4BIT = {
    "wgmma-m128-s3": {"WGMMA": {"num_stages": 3}, "BLOCK_M": 128},
    "wgmma-m128-s4": {"WGMMA": {"num_stages": 4}, "BLOCK_M": 128},
    "wgmma-m64-s4": {"WGMMA": {"num_stages": 4}, "BLOCK_M": 64},
}


def _quant_cases(tk, k, names, tokens, group_size=128):
    """(model name, T, layer copies, call(config) -> fn(i), reference output, bound seconds) for 4-bit experts
    (int4 symmetric in groups of `group_size`, g128 unless given; bf16 activations): rotated layer copies and the
    benchmark's routed inputs; `call` runs `experts` alone."""
    from .moe_dispatch import QUANT_FORMATS, QUANT_MAX_COPIES, QuantCase, make_quantized_layers, quant_expert_bytes
    from ..measure import measure_copy_bandwidth, rotation_count

    copy_bw = measure_copy_bandwidth()
    spec = {**QUANT_FORMATS["int4-g128"], "group_size": group_size}
    for name in names:
        m = MODELS[name]
        expert_bytes = quant_expert_bytes(k, m, spec)
        copies = rotation_count(m.top_k * expert_bytes, max_copies=QUANT_MAX_COPIES)
        layers = make_quantized_layers(k, m, copies, spec)
        for T in tokens:
            case = QuantCase(k, m, layers, T, f"int4-g{group_size}", expert_bytes, seed=T)
            outs = [torch.empty_like(x) for x in case.xs]

            def call(config, case=case, outs=outs):
                def fn(i):
                    weights, ids = case.routes[i]
                    return tk.experts(case.xs[i], case.layers[i].w_gate_up, case.layers[i].w_down, weights, ids,
                                      outs[i], config=config)
                return fn

            yield name, T, copies, call, case.reference(0).float(), case.weight_bytes() / copy_bw
            del case, outs
        del layers
        torch.cuda.empty_cache()


def _checked_seconds(call, config, ref, copies, label) -> tuple[float, float]:
    """(graph seconds, relative error against the per-expert loop) of one config; a wrong output stops the run."""
    err = ((call(config)(0).float() - ref).norm() / ref.norm()).item()
    if not err < 2e-2:
        raise RuntimeError(f"{label}: relative error {err:.3g}")
    return graph_seconds(call(config), copies), err


def gemv_4bit(tk, k, names, tokens, candidates, progress=None) -> list[dict]:
    """4-bit experts (int4 g128, bf16 activations) at GEMV token counts: each candidate of the gate/up GEMV with
    the heuristic's down, then each down candidate with the fastest gate/up, and the kernels the same T runs
    without the packed GEMVs; `experts` only (no router), timed as the benchmark times moe_forward, every
    candidate's output checked against the per-expert loop first. `progress(results)` after each (model, T)."""
    warm_clocks()
    results = []
    for name, T, copies, call, ref, bound in _quant_cases(tk, k, names, tokens):
        m = MODELS[name]
        config = tk.default_config(T, m.experts, m.hidden, m.intermediate, m.top_k, torch.device("cuda"),
                                   quantized=True, packed=True)
        if T > tk.GEMV_MAX_TOKENS:  # the tl.dot kernels this T ran before the packed GEMVs took it
            other = tk.default_config(T, m.experts, m.hidden, m.intermediate, m.top_k, torch.device("cuda"),
                                      quantized=True)
            results.append({"model": name, "T": T, "kernel": "both", "candidate": "tl.dot kernels",
                            "config": other, "seconds": graph_seconds(call(other), copies), "bound": bound})
            print(f"{name} T={T} tl.dot kernels: {results[-1]['seconds'] * 1e6:.1f} us", flush=True)
        for kernel in ("gate_up", "down"):
            timed = []
            for cand, plan in candidates.items():
                if kernel == "gate_up" and "SPLIT_K" in plan:
                    continue
                trial = {**config, kernel: plan}
                seconds, err = _checked_seconds(call, trial, ref, copies, f"{name} T={T} {kernel} {cand}")
                timed.append((seconds, trial))
                results.append({"model": name, "T": T, "kernel": kernel, "candidate": cand, "config": trial,
                                "seconds": seconds, "bound": bound, "err": err})
                print(f"{name} T={T} {kernel} {cand}: {seconds * 1e6:.1f} us (bound {bound * 1e6:.1f})", flush=True)
            config = min(timed, key=lambda tc: tc[0])[1]
        if progress:
            progress(results)
    return results


def _fits(block_m, decode: bool, per_expert: float) -> bool:
    """Whether a tl.dot candidate applies at this T: decode candidates at decode T; BLOCK_M 16-32 with at most 16
    pairs per expert, 16-64 with at most 64, else 64-128."""
    if decode or block_m is None:
        return decode and block_m is None
    return block_m in ((16, 32) if per_expert <= 16 else (16, 32, 64) if per_expert <= 64 else (64, 128))


def dot_4bit(tk, k, names, tokens, candidates, progress=None, compile_only=False) -> list[dict]:
    """4-bit experts (int4 g128, bf16 activations) on the tl.dot kernels (decode kernels up to DECODE_MAX_TOKENS,
    the grouped ones above): the tl.dot heuristic of formats without packed operands, with PACKED and SWAP_AB off
    (these kernels as they were before them), what `experts` runs by default (the packed GEMVs where they
    apply), above the decode cut the bf16 grouped kernels on experts dequantized first, and every candidate of
    `candidates` that fits T (`_fits`), each a whole config (both kernels), `experts` only, checked against the
    per-expert loop first; above the decode cut also the Gluon grouped kernel's plans of `candidates` (WGMMA_4BIT,
    Hopper: elsewhere such a config runs the default path). `compile_only`: the calls alone (to fill Triton's cache from several processes before a
    timing run)."""
    warm_clocks()
    results = []
    for name, T, copies, call, ref, bound in _quant_cases(tk, k, names, tokens):
        m = MODELS[name]
        decode = T <= tk.DECODE_MAX_TOKENS
        cuda = torch.device("cuda")
        fp32_planes = {key: {**v, "PACKED": False, "SWAP_AB": False} if isinstance(v, dict) else v
                       for key, v in tk.default_config(T, m.experts, m.hidden, m.intermediate, m.top_k, cuda,
                                                       quantized=True).items()}
        trials = {"tl.dot, fp32 planes": fp32_planes,
                  "default": tk.default_config(T, m.experts, m.hidden, m.intermediate, m.top_k, cuda, quantized=True,
                                               packed=True)}
        if not decode:  # the 16-bit grouped kernels on experts dequantized first (their tuned table)
            trials["dequantize first"] = {"DEQUANT": True, **tk.get_config(T, m.experts, m.hidden, m.intermediate,
                                                                           m.top_k, torch.bfloat16, cuda)}
        trials.update({cand: _dot_config(*spec) for cand, spec in candidates.items()
                       if cand in DOT_4BIT and _fits(spec[0], decode, T * m.top_k / m.experts)})
        trials.update({cand: config for cand, config in candidates.items() if cand in WGMMA_4BIT and not decode})
        for cand, config in trials.items():
            if compile_only:
                call(config)(0)
                continue
            seconds, err = _checked_seconds(call, config, ref, copies, f"{name} T={T} {cand}")
            results.append({"model": name, "T": T, "candidate": cand, "config": config, "seconds": seconds,
                            "bound": bound, "err": err})
            print(f"{name} T={T} {cand}: {seconds * 1e6:.1f} us (bound {bound * 1e6:.1f})", flush=True)
        if progress:
            progress(results)
    return results


def best_configs(results: list[dict]) -> dict[str, dict[int, dict]]:
    """The fastest candidate per (model, T); for decode the fastest of each kernel, or at T = 1 the fastest stream
    config where it beats them (the down search's rows ran with the best gate / up, so their best is the pair's)."""
    def fastest(rows):
        return min(rows, key=lambda r: r["seconds"])

    best: dict[str, dict[int, dict]] = {}
    for name, T in sorted({(r["model"], r["T"]) for r in results}, key=lambda mt: (mt[0], mt[1])):
        rows = [r for r in results if (r["model"], r["T"]) == (name, T)]
        if "kernel" in rows[0]:
            down = fastest([r for r in rows if r["kernel"] == "down"])
            config = decode_config(fastest([r for r in rows if r["kernel"] == "gate_up"])["candidate"],
                                   down["candidate"])
            streams = [r for r in rows if r["kernel"] == "stream"]
            if streams and fastest(streams)["seconds"] < down["seconds"]:
                config = stream_config(fastest(streams)["candidate"])
        else:
            config = grouped_config(fastest(rows)["candidate"])
        best.setdefault(name, {})[T] = config
    return best


def write_configs(tk, results: list[dict], directory: Path, device_name: str, run: dict) -> None:
    """One table per model, named as the kernel looks it up (`tk.config_path`), with `run` as provenance."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, per_t in best_configs(results).items():
        m = MODELS[name]
        path = directory / tk.config_path(m.experts, m.hidden, m.intermediate, torch.bfloat16, device_name).name
        table = {"device": device_name, "measured": [run], "tokens": {str(t): c for t, c in sorted(per_t.items())}}
        path.write_text(json.dumps(table, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build", type=Path, nargs="?")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs-from", type=Path, help="a saved tune-results.json: only write the configs")
    parser.add_argument("--device", help="with --configs-from: the GPU it was measured on, e.g. 'NVIDIA H200'")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--compile-only", action="store_true", help="also with --dot-4bit")
    parser.add_argument("--shard", default="0/1", help="I/N: this process's share of --compile-only")
    parser.add_argument("--gemv-4bit", nargs="*", type=int, metavar="T",
                        help="time the 4-bit experts' packed GEMV candidates at these token counts instead "
                             "(writes DIR/gemv-4bit-results.json, no configs)")
    parser.add_argument("--dot-4bit", nargs="*", type=int, metavar="T",
                        help="time the 4-bit experts' tl.dot candidates at these token counts instead "
                             "(writes DIR/dot-4bit-results.json, no configs)")
    parser.add_argument("--candidates", nargs="*", choices=sorted(PACKED) + sorted(DOT_4BIT) + sorted(WGMMA_4BIT),
                        help="with --gemv-4bit / --dot-4bit: only these")
    args = parser.parse_args()
    if args.configs_from and not args.device:
        parser.error("--configs-from needs --device")

    import kernels

    k = kernels.get_local_kernel(args.build)
    tk = k.ops.triton_kernels
    env = environment()
    for tokens, table, sweep, stem in ((args.gemv_4bit, PACKED, gemv_4bit, "gemv-4bit"),
                                       (args.dot_4bit, {**DOT_4BIT, **WGMMA_4BIT}, dot_4bit, "dot-4bit")):
        if tokens is None:
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{stem}-results.json"

        def write(results):
            path.write_text(json.dumps({"env": env, "rows": results}, indent=1) + "\n")

        candidates = {name: table[name] for name in args.candidates if name in table} if args.candidates else table
        extra = {"compile_only": True} if args.compile_only and sweep is dot_4bit else {}
        write(sweep(tk, k, args.models, tokens or [1], candidates, progress=write, **extra))
        return
    if args.configs_from:  # the file holds times only: the measuring run's versions are not known here
        write_configs(tk, json.loads(args.configs_from.read_text()), args.out / "configs", args.device,
                      {k: env[k] for k in ("command", "date")})
        return
    if args.compile_only:
        shard, shards = map(int, args.shard.split("/"))
        compile_shard(tk, args.models, shard, shards)
    else:
        results = tune(tk, args.models)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune-results.json").write_text(json.dumps(results, indent=1) + "\n")
        write_configs(tk, results, args.out / "configs", env["gpu"],
                      {k: env[k] for k in ("command", "date", "torch", "triton", "cuda")})


if __name__ == "__main__":
    main()
