"""W4A16 benchmark cases and the sweep behind the kernel's launch tables (``configs/<gpu>.json``).

`run(kernel)`: the Llama-3-8B / 70B linear shapes x M in TOKENS, int4 group 128 fp16 against cuBLAS fp16
``F.linear`` (weights dequantized from the same codes); bf16 on BF16_SHAPES at every M against cuBLAS bf16
and PyTorch's int4 GEMM (``aten._weight_int4pack_mm``, tinygemm, same codes and scales); NF4 (groups of 64) at
every M.
Every timed output is first checked against an fp32 matmul with the dequantized weight. Weights and
activations rotate through copies far larger than L2. Bytes are what each op must move once (ours: the
packed codes + scales as stored, activations, output); ``ideal_bytes`` is the all-int4 floor (N*K/2 +
activations + output).

`tune(kernel)`: times candidate launches of each path (GEMV, tl.dot, dequantize + cuBLAS) through the
kernel's launchers for every shape and M bucket and returns the table the kernel ships.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ..measure import (ClockLog, environment, measure_copy_bandwidth, measure_matmul_flops, rotation_count,
                       sustained_replays, time_graph, time_graphs_interleaved, warm_clocks)

SHAPES = (  # (label, K, N)
    ("L3-8B qkv", 4096, 6144),
    ("L3-8B o", 4096, 4096),
    ("L3-8B gate_up", 4096, 28672),
    ("L3-8B down", 14336, 4096),
    ("L3-70B qkv", 8192, 10240),
    ("L3-70B o", 8192, 8192),
    ("L3-70B gate_up", 8192, 57344),
    ("L3-70B down", 28672, 8192),
)
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
BF16_SHAPES = ("L3-8B gate_up", "L3-70B o")
GROUP = 128
NF4_GROUP = 64  # bitsandbytes' block size (until 2026-12-01 13:36 the NF4 rows used 128)
# Formats timed beside int4 g128 on every shape and M: NF4, and int4 with float minima in groups of 32 (the layout
# GGUF Q4_1 / Q4_K imports take, w4a16.load_gguf).
# Where the results bench (`run`) puts its weights and inputs: the GPU; its CPU test runs it through the
# interpreter with the timers stubbed ("cpu")
DEVICE = "cuda"
OTHER_FORMATS = {"ours-nf4": dict(fmt="nf4", group=NF4_GROUP), "ours-g32-min": dict(group=32, zero_point="float")}
INT4PACK_INNER_K_TILES = 8
# The goals: speed-up of ours over cuBLAS fp16 (geometric mean over SHAPES) per M.
# Issue #12's goals: speed-up over cuBLAS fp16 per M, NF4 against fp16 int4 on the same shapes, 70B streaming.
GOALS = {1: 3.0, 4: 2.5, 16: 2.5, 64: 1.5, 256: 1.0, 1024: 0.95, 4096: 0.95}
GOAL_NF4_VS_INT4 = 0.9
GOAL_PCT_COPY_70B = 80.0
GOAL_HEURISTIC_VS_TUNED = 0.9  # untuned shapes (the heuristic's launch) at least 0.9x the tuned launch's speed
FORMAT_NOTE = (f"`ours`: int4 symmetric (zero point 8) in scale groups of {GROUP}, fp16 scales; `ours-nf4`: NF4 in "
               f"groups of {NF4_GROUP}; `ours-g32-min`: int4 in groups of 32 with float minima (GGUF's layout). "
               "Integer zero points (AWQ, asymmetric GPTQ) are timed by `python -m hubtools.bench.w4a16 "
               "--compare-decode --zero-point`.")
HEURISTIC_NOTE = ("`ours-heuristic`: the same weights launched with `tuning.heuristic`'s config (with this card's "
                  "table thresholds) instead of the table's entry, i.e. what a shape without a tuned entry gets; "
                  "goal: tuned time / heuristic time >= 0.9.")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def _tolerance(dtype: torch.dtype) -> float:
    return 4e-3 if dtype == torch.float16 else 2e-2


def _timing_plan(m: int, slow: bool = False) -> dict:
    """Captured calls and replays: fewer for large M (each call is milliseconds) and slow baselines."""
    if slow and m >= 256:
        return {"calls": 2, "replays": 2}
    if m >= 1024:
        return {"calls": 6, "replays": 3}
    return {}


def _int4pack(codes: torch.Tensor, scales: torch.Tensor, n: int, k: int):
    """tinygemm operands for the same codes and scales: even K-column in the high nibble; its dequant is
    (q - 8) * scale + zero, so zero = 0 gives our symmetric weight."""
    packed = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous()
    weight = torch.ops.aten._convert_weight_to_int4pack(packed, INT4PACK_INNER_K_TILES)
    s = scales[:, :n].to(torch.bfloat16)
    scale_zero = torch.stack([s, torch.zeros_like(s)], dim=-1).contiguous()  # [K/g, N, 2]
    return weight, scale_zero


class _Shape:
    """Rotated copies of one shape's weights: ours (int4 / nf4), the fp16/bf16 dequantized weight."""

    def __init__(self, kernel, k: int, n: int, fmt: str = "int4", group: int = GROUP, zero_point=False):
        self.kernel, self.k, self.n = kernel, k, n
        weight = torch.randn(n, k, device=DEVICE, dtype=torch.float16) * 0.02
        self.qw = kernel.quantize(weight, group_size=group, fmt=fmt, zero_point=zero_point)
        del weight
        self.copies = rotation_count(self.qw.nbytes())
        self.qws = [self.qw] + [dataclasses.replace(self.qw, **{name: t.clone() for name, t in self.qw.tensors().items()})
                                for _ in range(self.copies - 1)]
        self.dense = kernel.dequantize(self.qw, torch.float32)

    def dense_copies(self, dtype: torch.dtype) -> list[torch.Tensor]:
        w = self.dense.to(dtype)
        return [w] + [w.clone() for _ in range(rotation_count(w.numel() * w.element_size()) - 1)]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.dense.t()

    def our_bytes(self, m: int) -> int:
        return self.qw.nbytes() + 2 * m * (self.k + self.n)

    def ideal_bytes(self, m: int) -> int:
        return self.n * self.k // 2 + 2 * m * (self.k + self.n)


def _inputs(m: int, k: int, dtype: torch.dtype, copies: int) -> list[torch.Tensor]:
    return [torch.randn(m, k, device=DEVICE, dtype=dtype) for _ in range(copies)]


def _verified(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> float:
    """`out`'s relative error against the float64-exact `ref`; an AssertionError past `dtype`'s tolerance."""
    err = _rel_err(out, ref)
    if not math.isfinite(err) or err > _tolerance(dtype):
        raise AssertionError(f"{what}verification failed: relative error {err:.3g}")
    return err


def _time_verified(fn: Callable[[int], torch.Tensor], copies: int, xs, ref_fn, dtype, plan: dict) -> tuple[float, float]:
    err = _verified(fn(0), ref_fn(xs[0]), dtype)
    return time_graph(fn, copies, **plan), err


def run(kernel, shapes=SHAPES, tokens=TOKENS, bf16_shapes=BF16_SHAPES) -> dict:
    warm_clocks()
    copy_bw = measure_copy_bandwidth()
    flops_peak = measure_matmul_flops()
    rows, notes = [], [FORMAT_NOTE, HEURISTIC_NOTE]
    device = torch.device(DEVICE)
    device_name, sm_count = kernel.tuning.device_info(device)
    thresholds = kernel.tuning.table(device_name).get("heuristic")
    for label, k, n in shapes:
        shape = _Shape(kernel, k, n)
        dense16 = shape.dense_copies(torch.float16)
        for m in tokens:
            case = f"{label} M={m} fp16"
            xs = _inputs(m, k, torch.float16, max(shape.copies, len(dense16)))
            base = {"flops": 2 * m * n * k}
            plan = _timing_plan(m)
            heuristic = kernel.tuning.heuristic(m, n, k, sm_count, thresholds)
            launches = (lambda i: kernel.matmul(xs[i], shape.qws[i % shape.copies]),
                        lambda i: _matmul_with(kernel, xs[i], shape.qws[i % shape.copies], heuristic),
                        lambda i: F.linear(xs[i], dense16[i % len(dense16)]))
            ref = shape.reference(xs[0])
            errs = [_verified(fn(0), ref, torch.float16) for fn in launches]
            # interleaved, each the best of its rounds (as time_graph's replays): timed one after the other, two
            # launches of the same config differed by up to 10 % (run 177, 70B M = 1)
            seconds = [min(t) for t in time_graphs_interleaved(launches, len(xs), calls=plan.get("calls"),
                                                                 rounds=plan.get("replays", 5))]
            rows.append({"case": case, "impl": "ours", "seconds": seconds[0], "bytes": shape.our_bytes(m),
                         "ideal_bytes": shape.ideal_bytes(m), "baseline": "cublas-fp16", "rel_err": errs[0],
                         "config": kernel.tuning.select(m, n, k, device), **base})
            rows.append({"case": case, "impl": "ours-heuristic", "seconds": seconds[1], "bytes": shape.our_bytes(m),
                         "ideal_bytes": shape.ideal_bytes(m), "baseline": "cublas-fp16", "rel_err": errs[1],
                         "config": heuristic, **base})
            rows.append({"case": case, "impl": "cublas-fp16", "seconds": seconds[2], "bytes": 2 * (n * k + m * (k + n)),
                         "rel_err": errs[2], **base})
            print(f"{case}: ours {rows[-3]['seconds'] * 1e6:.1f} us, heuristic {rows[-2]['seconds'] * 1e6:.1f} us, "
                  f"cublas {seconds[2] * 1e6:.1f} us", flush=True)
        del dense16
        if label in bf16_shapes:
            rows += _bf16_rows(kernel, shape, label, notes)
        del shape
        for impl, spec in OTHER_FORMATS.items():
            other = _Shape(kernel, k, n, **spec)
            for m in tokens:
                xs = _inputs(m, k, torch.float16, other.copies)
                t, err = _time_verified(lambda i: kernel.matmul(xs[i], other.qws[i]), other.copies, xs,
                                        other.reference, torch.float16, _timing_plan(m))
                rows.append({"case": f"{label} M={m} fp16", "impl": impl, "seconds": t, "bytes": other.our_bytes(m),
                             "ideal_bytes": other.ideal_bytes(m), "baseline": "cublas-fp16", "rel_err": err,
                             "flops": 2 * m * n * k})
            del other, xs
        torch.cuda.empty_cache()
    return {"kernel": "w4a16", "env": environment(), "copy_bandwidth": copy_bw, "matmul_flops": flops_peak,
            "rows": rows, "notes": notes}


def _matmul_with(kernel, x: torch.Tensor, qw, config: dict) -> torch.Tensor:
    """`kernel.matmul(x, qw)` (no bias, no act-order) launched with `config` instead of `tuning.select`'s."""
    n, k = qw.shape
    return kernel.triton_kernels.matmul(x, qw.qweight, qw.scales, qw.zeros, qw.codebook, None, n, k, qw.group_size,
                                        config, mins=qw.mins)


def _bf16_rows(kernel, shape: _Shape, label: str, notes: list) -> list[dict]:
    rows = []
    n, k = shape.n, shape.k
    dense = shape.dense_copies(torch.bfloat16)
    codes = kernel.formats.unpack(shape.qw.qweight, (n, k)).int()
    try:
        packs = [_int4pack(codes, shape.qw.scales, n, k) for _ in range(shape.copies)]
    except (RuntimeError, NotImplementedError) as exc:
        packs = None
        notes.append(f"`aten._weight_int4pack_mm` could not be prepared on this build ({label}): {exc}")
    for m in TOKENS:
        case = f"{label} M={m} bf16"
        xs = _inputs(m, k, torch.bfloat16, max(shape.copies, len(dense)))
        base = {"flops": 2 * m * n * k}
        plan = _timing_plan(m)
        t, err = _time_verified(lambda i: kernel.matmul(xs[i], shape.qws[i % shape.copies]), shape.copies, xs,
                                shape.reference, torch.bfloat16, plan)
        rows.append({"case": case, "impl": "ours", "seconds": t, "bytes": shape.our_bytes(m),
                     "ideal_bytes": shape.ideal_bytes(m), "baseline": "cublas-bf16", "rel_err": err, **base})
        t, err = _time_verified(lambda i: F.linear(xs[i], dense[i % len(dense)]), len(dense), xs,
                                shape.reference, torch.bfloat16, plan)
        rows.append({"case": case, "impl": "cublas-bf16", "seconds": t, "bytes": 2 * (n * k + m * (k + n)),
                     "rel_err": err, **base})
        if packs is not None:
            def tinygemm(i):
                weight, scale_zero = packs[i % len(packs)]
                return torch.ops.aten._weight_int4pack_mm(xs[i], weight, GROUP, scale_zero)
            try:
                t, err = _time_verified(tinygemm, len(packs), xs, shape.reference, torch.bfloat16,
                                        _timing_plan(m, slow=True))
                rows.append({"case": case, "impl": "int4pack", "seconds": t, "baseline": "cublas-bf16",
                             "bytes": n * k // 2 + 4 * (k // GROUP) * n + 2 * m * (k + n), "rel_err": err, **base})
            except (RuntimeError, AssertionError) as exc:
                notes.append(f"`aten._weight_int4pack_mm` failed at {case}: {exc}")
        print(f"{case}: ours {rows[-3 if packs else -2]['seconds'] * 1e6:.1f} us", flush=True)
    return rows


def goals(results: dict) -> list[dict]:
    """The issue's goals, evaluated on the measured rows: geometric-mean speed-ups, % of copy BW, vs tinygemm."""
    goal_shapes = {label for label, _, _ in SHAPES}  # the Llama-3 shapes; the others are reported only
    by_case: dict[str, dict] = {}
    for r in results["rows"]:
        if r["case"].split(" M=")[0] in goal_shapes:
            by_case.setdefault(r["case"], {})[r["impl"]] = r
    out = []

    def goal(name, case, value, target):
        out.append({"goal": name, "case": case, "value": value, "target": target, "met": value >= target})

    def geomean(values):
        return math.exp(sum(map(math.log, values)) / len(values))

    for m, target in GOALS.items():
        ratios = [c["cublas-fp16"]["seconds"] / c["ours"]["seconds"] for name, c in by_case.items()
                  if name.endswith(f" M={m} fp16") and "ours" in c and "cublas-fp16" in c]
        if ratios:
            goal(f"M={m}: geomean speed-up vs cuBLAS fp16", f"M={m} fp16, {len(ratios)} shapes", geomean(ratios),
                 target)

    def against_ours(m, impl, name, target):
        """ours time / `impl` time on each fp16 shape at M: their geomean as one goal."""
        ratios = [c["ours"]["seconds"] / c[impl]["seconds"] for case, c in by_case.items()
                  if case.endswith(f" M={m} fp16") and impl in c and "ours" in c]
        if ratios:
            goal(name, f"M={m} fp16, {len(ratios)} shapes", geomean(ratios), target)

    for m in GOALS:
        against_ours(m, "ours-nf4", "NF4: geomean int4 time / NF4 time", GOAL_NF4_VS_INT4)
        bf16 = [by_case[name.replace(" bf16", " fp16")]["ours"]["seconds"] / c["ours"]["seconds"]
                for name, c in by_case.items() if name.endswith(f" M={m} bf16") and "ours" in c
                and "ours" in by_case.get(name.replace(" bf16", " fp16"), {})]
        if bf16:
            goal("bf16: geomean fp16 time / bf16 time", f"M={m}, {len(bf16)} shapes", geomean(bf16),
                 GOAL_NF4_VS_INT4)
    for m in GOALS:
        against_ours(m, "ours-heuristic", "heuristic: geomean tuned time / heuristic time", GOAL_HEURISTIC_VS_TUNED)
    for name, c in by_case.items():
        if name.startswith("L3-70B") and name.endswith(" M=1 fp16"):
            r = c["ours"]
            goal("L3-70B M=1: % of copy BW (bytes moved)", name, 100 * r["bytes"] / r["seconds"] / results["copy_bandwidth"],
                 GOAL_PCT_COPY_70B)
    for name, c in by_case.items():
        if "int4pack" in c:
            goal("bf16: speed-up vs aten._weight_int4pack_mm", name, c["int4pack"]["seconds"] / c["ours"]["seconds"], 1.0)
    return out


# ---------------------------------------------------------------------------------------------------
# Tuning sweep: candidates per M bucket, timed through the kernel's launchers (explicit configs).

def _gemv_candidates() -> list[dict]:
    shapes = [(16, 16, 4, False), (8, 16, 4, False), (16, 8, 4, False), (8, 32, 4, False), (32, 8, 4, False),
              (16, 16, 4, True), (8, 16, 4, True), (32, 16, 8, False)]  # (block_n, tiles, num_warps, prefetch)
    return [{"kernel": "gemv", "block_n": bn, "tiles": t, "split_k": 1, "num_warps": w, "num_stages": 1,
             "prefetch": pf} for bn, t, w, pf in shapes]


def _dot_candidates(m: int) -> list[dict]:
    """Packed-operand dot tiles (`packed`: integer-op dequantization; formats it does not take run the
    dequantized planes on the same tiles), from the H200 probes of 2026-12-01: weight rows as the MMA's M
    (swap_ab), 4 warps up to M = 256, 256-token tiles above."""
    if m <= 16:
        shapes = [(16, 64, 4, 3), (16, 128, 8, 3), (16, 32, 4, 3)]
    elif m <= 64:
        shapes = [(64, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3)]
    elif m <= 256:
        shapes = [(128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (256, 128, 8, 3)]
    else:
        shapes = [(256, 128, 8, 3), (128, 256, 8, 3)]
    # (block_m, block_n, num_warps, num_stages)
    return [{"kernel": "dot", "block_m": bm, "block_n": bn, "swap_ab": True, "num_warps": w, "num_stages": st,
             "full_tile": True, "packed": True} for bm, bn, w, st in shapes]


def _compiled(jit_fn) -> dict:
    """Compiled variants of a Triton kernel by object id (diagnostics: registers, spills, code)."""
    found = {}
    for cache in getattr(jit_fn, "device_caches", {}).values():
        if isinstance(cache, tuple) and isinstance(cache[0], dict):
            found.update({id(ck): ck for ck in cache[0].values()})
    return found


def _snapshot(jit_fns: dict) -> dict:
    return {name: set(_compiled(fn)) for name, fn in jit_fns.items()}


def _new_since(jit_fns: dict, before: dict) -> dict:
    """{kernel name: compiled kernel} for the variants compiled after `before` (a `_snapshot`)."""
    return {name: ck for name, fn in jit_fns.items() for key, ck in _compiled(fn).items() if key not in before[name]}


def _splits(cfg: dict, m: int, n_rows: int, tiles: int, sm_count: int) -> list[int]:
    """Split-K factors worth timing: from filling one wave up to ~4 waves, keeping >= 4 K-tiles per split."""
    if cfg["kernel"] != "dot" or m > 256:
        return [cfg.get("split_k", 1)]
    programs = -(-m // cfg["block_m"]) * (n_rows // cfg["block_n"])
    return [s for s in (1, 2, 4, 8) if (s == 1 or programs * s <= 4 * sm_count) and tiles // s >= 4]


def tune(kernel, shapes=SHAPES, tokens=(1, 16, 64, 256, 1024), log: Callable[[str], None] = print) -> dict:
    """Fastest verified candidate per (shape, M bucket); returns {"shapes": ..., "trials": [...]}."""
    tk = kernel.triton_kernels
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    warm_clocks()
    table, trials, winners, compiled_by_config = {}, [], {}, {}
    jit_fns = {"gemv": tk.gemv._gemv_kernel, "gemv_half2": tk.gemv._gemv_h2_kernel, "dot": tk.dot._dot_kernel}
    for label, k, n in shapes:
        shape = _Shape(kernel, k, n)
        rows_padded, tiles = shape.qw.qweight.shape[0], shape.qw.qweight.shape[1] // 16
        entry = table.setdefault(f"{n}x{k}", {})
        for m in tokens:
            xs = _inputs(m, k, torch.float16, shape.copies)
            ref = shape.reference(xs[0])
            if m == 1:  # the fp32 GEMV (bf16, NF4, small groups) and the packed-fp16 one, tuned apart
                candidates = _gemv_candidates() + _half2_candidates(rows_padded, tiles, sm_count)
            elif m <= 64:
                candidates = _dot_candidates(m)
            else:
                candidates = _dot_candidates(m) + [{"kernel": "dequant", "chunk_n": c} for c in (0, 2048, 4096) if c < n]
            best, best_half2 = None, None
            for cand in candidates:
                for split in _splits(cand, m, rows_padded, tiles, sm_count):
                    cfg = dict(cand, split_k=split) if cand["kernel"] != "dequant" else cand

                    def call(i, cfg=cfg):
                        q = shape.qws[i % shape.copies]
                        return tk.matmul(xs[i], q.qweight, q.scales, q.zeros, q.codebook, None, n, k, GROUP, cfg)

                    started = time.perf_counter()
                    before = _snapshot(jit_fns)
                    try:
                        t, _ = _time_verified(call, shape.copies, xs, lambda _: ref, torch.float16,
                                              {"replays": 3, **_timing_plan(m)})
                    except Exception as exc:  # a candidate that fails to compile or verify is recorded, not fatal
                        trials.append({"shape": label, "m": m, "config": cfg, "error": f"{type(exc).__name__}: {exc}"[:300]})
                        log(f"  {label} M={m} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
                        continue
                    gbps = shape.our_bytes(m) / t / 1e9
                    trial = {"shape": label, "m": m, "config": cfg, "seconds": t, "GBps": gbps,
                             "wall": time.perf_counter() - started}
                    for name, ck in _new_since(jit_fns, before).items():
                        trial[name] = {"regs": ck.n_regs, "spills": ck.n_spills, "shared": ck.metadata.shared}
                        compiled_by_config[json.dumps(cfg, sort_keys=True)] = ck
                    trials.append(trial)
                    if cfg.get("half2"):
                        if best_half2 is None or t < best_half2[0]:
                            best_half2 = (t, cfg)
                    elif best is None or t < best[0]:
                        best = (t, cfg)
            if best is not None and best_half2 is not None:  # the fp32 winner, with the half2 winner's tiles
                h2 = {key: best_half2[1][key] for key in ("block_n", "tiles", "split_k", "num_warps", "num_stages",
                                                          "prefetch", "x_bcast", "tma") if key in best_half2[1]}
                log(f"{label} M={m}: best half2 {best_half2[0] * 1e6:.1f} us "
                    f"({shape.our_bytes(m) / best_half2[0] / 1e12:.2f} TB/s) {h2}")
                best = (best[0], dict(best[1], half2=h2))
            if best is not None:
                entry[str(m)] = best[1]
                winners.setdefault(m, []).append(best[1])
                log(f"{label} M={m}: best {best[0] * 1e6:.1f} us ({shape.our_bytes(m) / best[0] / 1e12:.2f} TB/s) {best[1]}")
        del shape
        torch.cuda.empty_cache()
    # The heuristic's M ranges for shapes without a table entry, from where each path won here (only the
    # ranges this sweep could decide: GEMV is a candidate at M = 1 only, dequantize from M = 256).
    heuristic = {}
    if 1 in winners:
        heuristic["gemv_max_m"] = 1
    large = [m for m in sorted(winners) if m >= 256]
    if large:
        dequant_from = [m for m in large if all(c["kernel"] == "dequant" for c in winners[m])]
        heuristic["dequant_min_m"] = dequant_from[0] if dequant_from else 2 * large[-1]
    code = {}
    for m in (1, 16):
        if m in winners and winners[m]:
            ck = compiled_by_config.get(json.dumps(winners[m][-1], sort_keys=True))
            if ck is not None:
                code[m] = {kind: ck.asm[kind] for kind in ("ttgir", "ptx", "cubin") if kind in ck.asm}
    return {"shapes": table, "heuristic": heuristic, "trials": trials, "code": code}


# ---------------------------------------------------------------------------------------------------
# The packed-fp16 GEMV (`half2` configs) against the fp32 GEMV and cuBLAS at M = 1.

QWEN_SHAPES = (  # (label, K, N): Qwen2.5-1.5B's linears (qkv = 1536 + 2 * 256 rows, gate_up fused)
    ("Q2.5-1.5B qkv", 1536, 2048),
    ("Q2.5-1.5B o", 1536, 1536),
    ("Q2.5-1.5B gate_up", 1536, 17920),
    ("Q2.5-1.5B down", 8960, 1536),
)


def _half2_candidates(rows: int, tiles: int, sm_count: int) -> list[dict]:
    """(block_n, tiles, num_warps, prefetch), with split-K where there are fewer than ~8 programs per SM."""
    base = [(8, 32, 4, False), (16, 16, 4, False), (8, 16, 4, False), (8, 32, 4, True), (16, 16, 4, True),
            (32, 16, 8, False), (8, 8, 4, False), (16, 8, 4, False),
            (8, 8, 4, True)]  # a probe after the 2026-12-01 sweep: 2-4% ahead of (8, 8, 4, False) on 70B gate_up / down
    out = []
    for bn, t, w, pf in base:
        programs = rows // bn
        splits = [1]
        if programs < 8 * sm_count:
            splits += [s for s in (2, 4, 8) if -(-tiles // s) >= 2 and programs * s <= 16 * sm_count]
        out += [{"kernel": "gemv", "block_n": bn, "tiles": t, "split_k": s, "num_warps": w, "num_stages": 1,
                 "prefetch": pf, "half2": True} for s in splits]
    # x broadcast over the rows with a 3-stage ring of the weight tiles (TMA or cp.async), 2 or 4 warps: the
    # 2026-12-01 winners on the long-K shapes (docs/design/w4a16.md, E1b / E1c)
    programs = rows // 16
    splits = [1] + [s for s in (2, 4) if programs * s <= 8 * sm_count and tiles // s >= 16]
    out += [{"kernel": "gemv", "block_n": 16, "tiles": 8, "split_k": s, "num_warps": w, "num_stages": 3,
             "prefetch": False, "x_bcast": True, "tma": tma, "half2": True}
            for w, tma in ((2, True), (4, True), (4, False)) for s in splits]
    return out


def _sass_loop_counts(sass: str) -> dict:
    """Opcode counts of the longest backward-branch region (the K loop) of a cuobjdump/nvdisasm listing."""
    import re
    lines, labels, best = sass.splitlines(), {}, None
    for i, line in enumerate(lines):
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = i
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        if m and m.group(1) in labels and (best is None or i - labels[m.group(1)] > best[1] - best[0]):
            best = (labels[m.group(1)], i)
    counts: dict[str, int] = {}
    for line in (lines[best[0]:best[1] + 1] if best else []):
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            counts[m.group(2)] = counts.get(m.group(2), 0) + 1
    return counts


def _code_report(ck, weights_per_thread_iter: int, out_dir, name: str) -> dict:
    """Registers, spills, PTX opcode counts and SASS K-loop instruction counts of one compiled kernel."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    ptx = ck.asm.get("ptx", "")
    ptx_ops: dict[str, int] = {}
    for line in ptx.splitlines():
        m = re.match(r"\s+(?:@%p\d+\s+)?([a-z][a-z0-9]*(?:\.[a-z0-9]+)*)", line)
        if m and not m.group(1).startswith(("reg", "loc", "file")):
            op = m.group(1)
            ptx_ops[op] = ptx_ops.get(op, 0) + 1
    top_ptx = dict(sorted(ptx_ops.items(), key=lambda kv: -kv[1])[:30])
    report = {"regs": ck.n_regs, "spills": ck.n_spills, "ptx_ops": top_ptx}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            cubin.write_bytes(ck.asm["cubin"])
            import os

            import triton

            tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
            tool = tool if os.path.exists(tool) else "nvdisasm"  # nvdisasm prints the branch labels
            sass = subprocess.run([tool, "-c", str(cubin)], capture_output=True, text=True, timeout=60).stdout
        (Path(out_dir) / f"{name}.sass").write_text(sass)
        loop = _sass_loop_counts(sass)
        total = sum(loop.values())
        report.update({"sass_loop_total": total, "sass_loop": dict(sorted(loop.items(), key=lambda kv: -kv[1])),
                       "weights_per_thread_iter": weights_per_thread_iter,
                       "sass_per_weight": total / weights_per_thread_iter if weights_per_thread_iter else None})
    except Exception as exc:  # cuobjdump missing: PTX counts only
        report["sass_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return report


def compare_gemv(kernel, shapes=SHAPES + QWEN_SHAPES, out_dir=".", log: Callable[[str], None] = print) -> dict:
    """M = 1, int4 g128 fp16: the shipped fp32 GEMV config, every packed-fp16 candidate, and cuBLAS fp16, each
    verified (and the best half2 config again with |x| ~ 1000) and graph-timed."""
    tk, tuning = kernel.triton_kernels, kernel.tuning
    device = torch.device("cuda")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    warm_clocks()
    copy_bw = measure_copy_bandwidth()
    result = {"env": environment(), "copy_bandwidth": copy_bw, "shapes": [], "code": {}}
    jit_fns = {"old": tk.gemv._gemv_kernel, "half2": tk.gemv._gemv_h2_kernel}
    compiled_for: dict[str, tuple] = {}
    for label, k, n in shapes:
        shape = _Shape(kernel, k, n)
        xs = _inputs(1, k, torch.float16, shape.copies)
        nbytes = shape.our_bytes(1)
        rows, tiles = shape.qw.qweight.shape[0], shape.qw.qweight.shape[1] // 16

        def evaluate(cfg):
            def call(i):
                q = shape.qws[i % shape.copies]
                return tk.matmul(xs[i], q.qweight, q.scales, q.zeros, q.codebook, None, n, k, GROUP, cfg)

            before = _snapshot(jit_fns)
            try:
                t, err = _time_verified(call, shape.copies, xs, shape.reference, torch.float16, {"replays": 5})
            except Exception as exc:
                log(f"  {label} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
                return {"config": cfg, "error": f"{type(exc).__name__}: {exc}"[:300]}
            for name, ck in _new_since(jit_fns, before).items():
                compiled_for[json.dumps(cfg, sort_keys=True)] = (name, ck)
            return {"config": cfg, "us": t * 1e6, "TBps": nbytes / t / 1e12, "rel_err": err}

        shipped = dict(tuning.select(1, n, k, device))
        old = evaluate(dict(shipped, half2=False))
        trials = [evaluate(c) for c in _half2_candidates(rows, tiles, sm_count)]
        ok = [t for t in trials if "us" in t]
        best = min(ok, key=lambda t: t["us"]) if ok else None
        dense16 = shape.dense_copies(torch.float16)
        t_cublas, cublas_err = _time_verified(lambda i: F.linear(xs[i], dense16[i % len(dense16)]), len(dense16), xs,
                                              shape.reference, torch.float16, {"replays": 5})
        big_err = None
        if best is not None:
            xb = xs[0] * 1000
            q = shape.qw
            big_err = _rel_err(tk.matmul(xb, q.qweight, q.scales, None, None, None, n, k, GROUP, best["config"]),
                               shape.reference(xb))
        result["shapes"].append({"shape": label, "N": n, "K": k, "bytes": nbytes, "copies": shape.copies, "old": old,
                                 "best_half2": best, "cublas_us": t_cublas * 1e6, "cublas_rel_err": cublas_err,
                                 "best_half2_rel_err_x1000": big_err, "trials": trials})
        if "us" in old and best:
            log(f"{label}: old {old['us']:.1f} us ({old['TBps']:.2f} TB/s, {t_cublas * 1e6 / old['us']:.2f}x cuBLAS) | "
                f"half2 {best['us']:.1f} us ({best['TBps']:.2f} TB/s, {t_cublas * 1e6 / best['us']:.2f}x cuBLAS, "
                f"err {best['rel_err']:.1e}, x1000 {big_err:.1e}) | cuBLAS {t_cublas * 1e6:.1f} us "
                f"| {best['config']['block_n']}/{best['config']['tiles']}/{best['config']['split_k']}/"
                f"{best['config']['num_warps']}/{int(best['config']['prefetch'])}")
        del shape, dense16, xs
        torch.cuda.empty_cache()
        if label == "L3-70B gate_up" and best is not None:  # code of the largest shape's winners, both kernels
            for name, cfg in (("old", old["config"]), ("half2", best["config"])):
                entry = compiled_for.get(json.dumps(cfg, sort_keys=True))
                if entry is not None:
                    wpt = cfg["block_n"] * cfg["tiles"] * 128 // (32 * cfg.get("num_warps", 4))
                    result["code"][name] = dict(_code_report(entry[1], wpt, out_dir, f"{name}_gate_up70b"),
                                                config=cfg)
    return result


# ---------------------------------------------------------------------------------------------------
# Decode-path experiments (issue 12): the shipped config, candidate launches and cuBLAS fp16, per shape and M.

OTHER_SHAPES = (  # (label, K, N): model shapes in no tuned table (Llama-2-7B / Mistral-7B-class MLP)
    ("L2-7B gate_up", 4096, 22016),
    ("L2-7B down", 11008, 4096),
)


def _pipeline_candidates(m: int, rows: int, tiles: int, sm_count: int) -> list[dict]:
    """M = 1 packed-fp16 GEMV launches with x broadcast over the rows (`x_bcast`) and the weight tiles through a
    TMA ring (`tma`) or a cp.async ring: tile shapes, ring depths and warps around the 2026-12-01 winner (16 x 8,
    3 stages, TMA), split-K where programs are few. (Runs 1-3 of docs/design/w4a16.md record the candidates
    they timed in their output files.)"""
    if m != 1:
        return []
    base = [  # (block_n, tiles, num_stages, tma, num_warps)
        (16, 8, 3, True, 4), (16, 8, 4, True, 4), (16, 8, 5, True, 4), (8, 8, 5, True, 4), (16, 4, 4, True, 4),
        (16, 4, 6, True, 4), (32, 4, 4, True, 4), (16, 8, 3, True, 8), (16, 16, 3, True, 8), (32, 8, 3, True, 8),
        (16, 8, 3, True, 2), (16, 8, 4, False, 4),
    ]
    out = []
    for bn, t, st, tma, w in base:
        programs = rows // bn
        splits = [1] + [s for s in (2, 4) if programs * s <= 8 * sm_count and tiles // s >= 16]
        out += [{"kernel": "gemv", "block_n": bn, "tiles": t, "split_k": s, "num_warps": w, "num_stages": st,
                 "prefetch": False, "x_bcast": True, "tma": tma, "half2": True} for s in splits]
    return out


def _dot_pipeline_candidates(m: int, rows: int, tiles: int, sm_count: int) -> list[dict]:
    """M > 1 launches (E2 of docs/design/w4a16.md; every row of the output files records its config): tensor-core
    tiles with x and the weight words by pointer loads or TMA descriptors (`x_desc` / `w_desc`) at each split-K
    that keeps programs within a few waves; at M >= 1024 also fused tiles against dequantize + cuBLAS (run 10
    also timed the dequantize kernel before E2b, as `natural: false`). Run 9 had also timed the scale on the
    operand at 4 warps: slower everywhere, so it is left out."""
    if m <= 1:
        return []
    if m <= 16:
        base, most = [(16, 64, 4, 3), (16, 128, 4, 3), (16, 32, 4, 3), (16, 64, 4, 4), (16, 128, 8, 3)], 8
    elif m <= 64:
        base, most = [(64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3), (32, 64, 4, 3)], 4
    elif m <= 256:
        base, most = [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (256, 128, 8, 3), (64, 128, 4, 3),
                      (64, 64, 4, 3)], 2
    else:
        base, most = [(128, 64, 4, 3), (128, 128, 8, 3), (256, 128, 8, 3), (128, 256, 8, 3)], 1
    out = []
    for bm, bn, w, st in base:
        programs = -(-m // bm) * (rows // bn)
        splits = [s for s in (1, 2, 4, 8) if s == 1 or (programs * s <= most * sm_count and tiles // s >= 4)]
        for desc in (True, False):
            out += [{"kernel": "dot", "block_m": bm, "block_n": bn, "split_k": s, "swap_ab": True, "num_warps": w,
                     "num_stages": st, "full_tile": True, "packed": True, "x_desc": desc, "w_desc": desc} for s in splits]
    if m >= 1024:
        out += [{"kernel": "dequant", "chunk_n": c} for c in (0, 4096)]
    return out


def _decode_candidates(m: int, rows: int, tiles: int, sm_count: int, fmt: str = "int4") -> list[dict]:
    if fmt == "nf4":
        return _nf4_candidates(m, rows, tiles, sm_count)
    return _pipeline_candidates(m, rows, tiles, sm_count) + _dot_pipeline_candidates(m, rows, tiles, sm_count)


def _nf4_candidates(m: int, rows: int, tiles: int, sm_count: int) -> list[dict]:
    """NF4 at M > 1 (E3 of docs/design/w4a16.md): the int4 tiles with the codebook looked up by byte permutes,
    the first of them also with the per-weight gathers of before, and dequantize + cuBLAS."""
    tiles_ = _dot_pipeline_candidates(m, rows, tiles, sm_count)
    dots = [dict(c, packed=False, nf4_tables=True) for c in tiles_ if c["kernel"] == "dot" and c["split_k"] <= 4
            and c["x_desc"] == (m > 16)]
    gathers = [dict(c, nf4_tables=False) for c in dots[:2]]
    return dots + gathers + [{"kernel": "dequant", "chunk_n": c} for c in (0, 4096)]


def compare_decode(kernel, shapes=SHAPES + QWEN_SHAPES + OTHER_SHAPES, tokens=(1,), candidates=_decode_candidates,
                   out_path=None, log: Callable[[str], None] = print, fmt: str = "int4", group: int = GROUP,
                   variants: list[dict] | None = None, zero_point: bool = False,
                   x_dtype: torch.dtype = torch.float16, rounds: int | None = None) -> dict:
    """`fmt` (int4, symmetric or with integer `zero_point`s, or NF4) with groups of `group` and activations of
    `x_dtype` at each M in `tokens`: the shipped config (`tuning.select`), every candidate launch and cuBLAS in
    `x_dtype` in one process, each verified against the float64-exact fp32 reference and graph-timed
    (rotated weights), with registers / shared memory of each compiled variant. With `rounds`, the shipped config,
    the candidates and cuBLAS are then timed again interleaved (`time_graphs_interleaved`): each row's ``us`` is
    the median of its ``us_rounds``. Written to `out_path` after every shape, so a run cut short keeps what it
    measured."""
    tk, tuning = kernel.triton_kernels, kernel.tuning
    device = torch.device("cuda")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    warm_clocks()
    result = {"env": environment(), "copy_bandwidth": measure_copy_bandwidth(), "fmt": fmt, "group": group,
              "zero_point": zero_point, "x_dtype": str(x_dtype).removeprefix("torch."), "rows": []}
    jit_fns = {"gemv_half2": tk.gemv._gemv_h2_kernel, "dot": tk.dot._dot_kernel, "gemv": tk.gemv._gemv_kernel}
    resources: dict[str, dict] = {}
    for label, k, n in shapes:
        shape = _Shape(kernel, k, n, fmt=fmt, group=group, zero_point=zero_point)
        rows_padded, tiles = shape.qw.qweight.shape[0], shape.qw.qweight.shape[1] // 16
        dense16 = shape.dense_copies(x_dtype)
        for m in tokens:
            xs = _inputs(m, k, x_dtype, max(shape.copies, len(dense16)))
            ref = shape.reference(xs[0])
            nbytes = shape.our_bytes(m)
            plan = {"replays": 5, **_timing_plan(m)}

            def launch(cfg):
                def call(i):
                    q = shape.qws[i % shape.copies]
                    return tk.matmul(xs[i], q.qweight, q.scales, q.zeros, q.codebook, None, n, k, group, cfg)

                return call

            def evaluate(name, cfg):
                before = _snapshot(jit_fns)
                row = {"shape": label, "N": n, "K": k, "m": m, "impl": name, "config": cfg}
                try:
                    t, err = _time_verified(launch(cfg), shape.copies, xs, lambda _: ref, x_dtype, plan)
                except Exception as exc:  # a candidate that fails to compile or verify is recorded, not fatal
                    log(f"  {label} M={m} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
                    return dict(row, error=f"{type(exc).__name__}: {exc}"[:300])
                key = json.dumps(cfg, sort_keys=True)
                for kname, ck in _new_since(jit_fns, before).items():
                    resources.setdefault(key, {})[kname] = {"regs": ck.n_regs, "spills": ck.n_spills,
                                                            "shared": ck.metadata.shared}
                return dict(row, us=t * 1e6, TBps=nbytes / t / 1e12, pct_copy=100 * nbytes / t / result["copy_bandwidth"],
                            rel_err=err, code=resources.get(key))

            shipped_config = dict(tuning.select(m, n, k, device, nf4_group=group if fmt == "nf4" else None))
            shipped = evaluate("shipped", shipped_config)
            if variants is None:
                launches = candidates(m, rows_padded, tiles, sm_count, fmt)
            else:  # the shipped config with each override (nested dicts such as "mma" merged), nothing else; on top
                # of what runs for this dtype, so that a table's own "bf16" keys do not replace a variant's
                runs = tuning.for_activations(shipped_config, x_dtype)
                launches = [_override(runs, v) for v in variants]
            trials = [evaluate("candidate", c) for c in launches]
            def dense(i):
                return F.linear(xs[i], dense16[i % len(dense16)])

            t_cublas, cublas_err = _time_verified(dense, len(dense16), xs, lambda _: ref, x_dtype, plan)
            cublas = {"shape": label, "N": n, "K": k, "m": m, "impl": f"cublas-{result['x_dtype']}",
                      "us": t_cublas * 1e6, "rel_err": cublas_err}
            if rounds:  # ours and cuBLAS again, in the same rounds (each over all of xs, its weights in turn)
                timed = [row for row in (shipped, *trials) if "us" in row]
                per_round = time_graphs_interleaved([launch(row["config"]) for row in timed] + [dense], len(xs),
                                                    calls=plan.get("calls"), rounds=rounds)
                for row, seconds in zip(timed, per_round):
                    t = statistics.median(seconds)
                    row.update(us=t * 1e6, us_rounds=[x * 1e6 for x in seconds], TBps=nbytes / t / 1e12,
                               pct_copy=100 * nbytes / t / result["copy_bandwidth"])
                t_cublas = statistics.median(per_round[-1])
                cublas.update(us=t_cublas * 1e6, us_rounds=[x * 1e6 for x in per_round[-1]])
            result["rows"] += [shipped, *trials, cublas]
            ok = [t for t in trials if "us" in t]
            best = min(ok, key=lambda t: t["us"]) if ok else None
            line = f"{label} M={m}: cuBLAS {t_cublas * 1e6:.1f} us"
            if "us" in shipped:
                line += f" | shipped {shipped['us']:.1f} us ({shipped['pct_copy']:.0f}%, {t_cublas * 1e6 / shipped['us']:.2f}x)"
            if best:
                line += (f" | best {best['us']:.1f} us ({best['pct_copy']:.0f}%, {t_cublas * 1e6 / best['us']:.2f}x) "
                         + json.dumps({key: best["config"][key] for key in best["config"] if key not in ("kernel", "half2")}))
            log(line)
            del xs
        del shape, dense16
        torch.cuda.empty_cache()
        if out_path is not None:
            out_path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _merge_into(table_path, compared: dict, min_gain: float) -> None:
    """`merge_compare` of a `compare_decode` result into the table file at `table_path`, rewritten in place."""
    table = json.loads(table_path.read_text())
    print("\n".join(merge_compare(table, compared, min_gain=min_gain)))
    table_path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {table_path}")


def bench_as_compare(results: dict, table: dict, tuned_config: Callable[..., dict | None],
                     tokens=None) -> dict:
    """A results bench (`run`, symmetric int4 g128, fp16 x) as a `compare_decode` result: per Llama-3 shape and M
    (those in `tokens`, default every one), its "ours" row as the shipped launch and its "ours-heuristic" row as
    the one candidate, so that `merge_compare` writes the heuristic's launch where it beat the table in that run.
    An "ours" row's config is its own (recorded since 2026-12-07) or, in older files, what `table` holds for it
    (`tuned_config`, the kernel's `tuning.tuned_config`): the table must then be the one the bench ran, unchanged
    since in its int4 configs. Shapes without an entry ran the heuristic as "ours" and are left out."""
    if results.get("kernel") != "w4a16":
        raise ValueError(f"not a w4a16 results bench (kernel {results.get('kernel')!r})")
    labels = {label: (k, n) for label, k, n in SHAPES}
    rows = []
    for row in results["rows"]:
        label, rest = row["case"].split(" M=")
        m, x_dtype = rest.split(" ", 1)
        m = int(m)
        if (x_dtype != "fp16" or label not in labels or row["impl"] not in ("ours", "ours-heuristic")
                or (tokens and m not in tokens)):
            continue
        k, n = labels[label]
        config = row.get("config")
        if config is None:
            config = tuned_config(table, m, n, k)
            if config is None:
                continue
            config = {key: value for key, value in config.items() if key != "nf4"}  # as `tuning.select` gives
        rows.append({"shape": label, "N": n, "K": k, "m": m, "config": config, "us": row["seconds"] * 1e6,
                     "impl": "shipped" if row["impl"] == "ours" else "candidate"})
    return {"env": results["env"], "fmt": "int4", "group": GROUP, "zero_point": False, "x_dtype": "float16",
            "rows": rows}


def _override(config: dict, variant: dict) -> dict:
    """`config` with `variant`'s keys; a dict-valued key that both have (``"mma"``, ``"half2"``) merges one level
    down, so ``{"mma": {"tiles": 4}}`` keeps each shape's other mma settings."""
    return {**config, **{key: {**config[key], **value} if isinstance(value, dict) and isinstance(config.get(key), dict)
                         else value for key, value in variant.items()}}


OVERRIDES = ("bf16", "nf4")  # a table entry's keys for other activations / formats (`merge_compare` keeps them)


def merge_compare(table: dict, result: dict, shapes=SHAPES, min_gain: float = 0.03) -> list[str]:
    """Put the fastest verified launch of a `compare_decode` result into `table` for each of `shapes` and
    each M measured (its bucket), where it beats the shipped config timed beside it by more than `min_gain`
    (smaller differences are run-to-run noise); returns one line per change. An M measured above all of a changed
    entry's buckets keeps the config it ran as a bucket of its own. Shapes outside `shapes` (the
    untuned ones that check the heuristic) are never written. A result with bf16 x goes into the entry's
    ``"bf16"`` override (`tuning.for_activations`): the winner's keys that differ from the entry tuned with fp16
    x, which must exist; an int4 winner with fp16 x keeps the bf16 and NF4 overrides of the entry it replaces.
    An NF4 result (fp16 x, any group size) goes into the entry's ``"nf4"`` keys (`tuning.nf4_tiles`), which hold
    the wgmma tile and the decode kernels' plans (`NF4_OVERRIDE_KEYS`): a winner that differs from the shipped NF4
    launch in anything else is not written."""
    measured = (result.get("fmt", "int4"), result.get("group", GROUP), result.get("zero_point", False))
    x_dtype = result.get("x_dtype", "float16")
    nf4 = measured[0] == "nf4" and x_dtype == "float16"
    if not nf4 and (measured != ("int4", GROUP, False) or x_dtype not in ("float16", "bfloat16")):
        raise ValueError(f"the table is tuned on symmetric int4 g{GROUP} with fp16 x (bf16 x and NF4 with fp16 x as "
                         f"overrides); this result is {result.get('fmt')} g{result.get('group')}, zero points "
                         f"{result.get('zero_point', False)}, x {x_dtype}")
    labels = {label: (k, n) for label, k, n in shapes}
    best: dict[tuple, dict] = {}
    shipped: dict[tuple, dict] = {}
    for row in result["rows"]:
        key = (row["shape"], row["m"])
        if row["shape"] not in labels or "us" not in row:
            continue
        if row["impl"] == "shipped":
            shipped[key] = row
        elif row["impl"] == "candidate" and (key not in best or row["us"] < best[key]["us"]):
            best[key] = row
    changes = []
    touched = set()
    for key, row in sorted(best.items()):
        label, m = key
        if key in shipped and row["us"] > shipped[key]["us"] * (1 - min_gain):
            continue
        k, n = labels[label]
        was = f"{shipped[key]['us']:.1f}" if key in shipped else "-"
        if nf4:
            changes.append(_merge_nf4(table.get("shapes", {}).get(f"{n}x{k}", {}), label, m, row,
                                      shipped.get(key), was))
            continue
        entries = table.setdefault("shapes", {}).setdefault(f"{n}x{k}", {})
        config = {name: value for name, value in row["config"].items() if name not in OVERRIDES}
        if x_dtype == "bfloat16":
            entry = entries.get(str(m))
            if entry is None:
                changes.append(f"{label} M={m}: no entry tuned with fp16 x to hold a bf16 override; not written")
                continue
            config = {name: value for name, value in config.items() if entry.get(name) != value}
            entry["bf16"] = config
        else:  # an entry's bf16 / NF4 overrides stay: they say what bf16 x and NF4 run, whatever int4 now runs
            before = entries.get(str(m), {})
            entries[str(m)] = {**config, **{name: before[name] for name in OVERRIDES if name in before}}
        touched.add(label)
        changes.append(f"{label} M={m}{' bf16' if x_dtype == 'bfloat16' else ''}: {was} -> {row['us']:.1f} us "
                       f"{json.dumps(config, sort_keys=True)}")
    # An entry's largest bucket also runs every larger M: where this merge changed a shape, each M measured above
    # all its buckets keeps the config it ran when measured (a winner at M = 1024 must not take M = 4096 along)
    for (label, m), row in sorted(shipped.items()):
        k, n = labels[label]
        entries = table.get("shapes", {}).get(f"{n}x{k}", {})
        if label in touched and all(int(bucket) < m for bucket in entries):
            # what ran there, with the NF4 keys of the bucket it ran in (`tuning.select` leaves them out)
            ran_nf4 = entries[str(max(int(bucket) for bucket in entries))].get("nf4")
            entries[str(m)] = row["config"] if ran_nf4 is None else {**row["config"], "nf4": ran_nf4}
            changes.append(f"{label} M={m}: keeps {json.dumps(row['config'], sort_keys=True)} (a bucket below "
                           "changed)")
    env = result["env"]
    table.setdefault("measured", []).append({key: env[key] for key in ("date", "torch", "triton", "cuda", "command")})
    return changes


def wgmma_split_regret(choose: Callable[..., int], results: list[dict], sm_count: int) -> list[dict]:
    """How `choose` (`tuning.wgmma_split`, or a variant with other constants) does on `compare_decode` results:
    for each (result, shape, M, wgmma tile) whose splits were timed at two or more counts, the time of the split
    it picks over the fastest one measured (1.0: it picked the fastest). To check or refit the model's constants on
    another GPU from a sweep over ``"split_k"`` 1 / 2 / 4 (docs/design/w4a16.md E43)."""
    timed: dict[tuple, dict] = {}
    for index, result in enumerate(results):
        for row in result["rows"]:
            tile = row.get("config", {}).get("wgmma")
            if "us" not in row or not tile or not isinstance(tile.get("split_k", 1), int):
                continue
            key = (index, row["shape"], row["N"], row["K"], row["m"],
                   json.dumps({name: value for name, value in tile.items() if name != "split_k"}, sort_keys=True))
            timed.setdefault(key, {})[tile.get("split_k", 1)] = row["us"]
    out = []
    for (_, shape, n, k, m, tile), splits in timed.items():
        if len(splits) < 2:
            continue
        fields = json.loads(tile)
        rows = -(-n // 128) * 128  # the padded rows the launcher passes (w4a16's formats.PAD_N)
        picked = choose(m, rows, k, fields["block_m"], fields.get("block_n", 128), sm_count)
        if picked in splits:
            out.append({"shape": shape, "m": m, "tile": fields, "picked": picked, "splits": splits,
                        "regret": splits[picked] / min(splits.values())})
    return out


# The keys an NF4 override may hold (`tuning.nf4_tiles`): the wgmma tile, the decode kernels' own plans, and the
# choice of the pair table and its size (the dot path picks the size that keeps its programs an SM unless a plan
# pins it, E75).
NF4_OVERRIDE_KEYS = ("wgmma", "half2", "mma", "nf4_smem", "nf4_table_copies")


def _merge_nf4(entries: dict, label: str, m: int, row: dict, shipped: dict | None, was: str) -> str:
    """`merge_compare` of one NF4 winner into the bucket's ``"nf4"`` keys: its wgmma tile (none: that key goes) and
    its packed-GEMV / mma plan where it differs from the shipped launch's (the whole dict, replacing the int4
    entry's); a winner that differs in any other key, or lacks a decode plan the shipped launch had, is not
    written. One line saying what was done."""
    entry = entries.get(str(m))
    if entry is None or shipped is None:
        return f"{label} M={m} nf4: no tuned entry or shipped launch to set an override against; not written"
    winner, before = row["config"], shipped["config"]
    differs = sorted(name for name in set(winner) | set(before) if winner.get(name) != before.get(name))
    others = [name for name in differs if name not in NF4_OVERRIDE_KEYS]
    lost = [name for name in differs if name != "wgmma" and name not in winner]
    if others or lost:
        return (f"{label} M={m} nf4: the winner differs from the shipped launch in {others or lost}, not only in "
                f"{list(NF4_OVERRIDE_KEYS)}; not written")
    override = {name: value for name, value in entry.get("nf4", {}).items() if name != "wgmma"}
    override.update({name: winner[name] for name in differs if name != "wgmma"})
    if winner.get("wgmma"):
        override["wgmma"] = winner["wgmma"]
    if override:
        entry["nf4"] = override
    else:
        entry.pop("nf4", None)
    return f"{label} M={m} nf4: {was} -> {row['us']:.1f} us {json.dumps(entry.get('nf4'), sort_keys=True)}"


def stand_in_table(kernel, device_name: str, table_path=None):
    """Make `kernel` (a build in a folder of its own, as `loaded_kernel` makes) take the launch table at
    `table_path` as `device_name`'s own, or no table (the heuristic) when None: to time one GPU's table on another
    card (the H200's on an H100) or a card's table against the heuristic in one call. Only the build changes."""
    from pathlib import Path

    target = kernel.tuning.table_path(device_name)
    target.unlink(missing_ok=True)  # a new file, never a write through whatever stood there
    if table_path is not None:
        target.write_text(Path(table_path).read_text())
    kernel.tuning.table.cache_clear()


def dequant_bandwidth(kernel, shapes=SHAPES, fmt: str = "int4", group: int = GROUP,
                      variants: list[dict] | None = None) -> dict:
    """The dequantize kernel alone (dequantize + cuBLAS runs it at M >= 512): seconds per call into a preallocated
    fp16 output by CUDA-graph replay over rotated weights, the bytes it must move (4-bit words, scales, zeros in;
    fp16 out) and their share of the device copy bandwidth measured in the same run; for each of `variants`
    (keyword arguments of `triton_kernels.dequantize`: ``block_n``, ``tiles``, ``num_warps``, ``nf4_tables``;
    by default the kernel's defaults). A first row per shape, ``{"store_only": true}``, times ``out.fill_`` alone:
    its share (the same bytes over its time) is what the kernel could reach if storing its output were the limit."""
    warm_clocks()
    bandwidth = measure_copy_bandwidth()
    rows = []
    for label, k, n in shapes:
        def make():
            w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
            return kernel.quantize(w, group_size=group, zero_point=fmt == "int4", fmt=fmt)
        first = make()
        out = torch.empty(n, k, device="cuda", dtype=torch.float16)
        moved = sum(t.numel() * t.element_size() for t in (first.qweight, first.scales, first.zeros, out)
                    if t is not None)
        weights = [first] + [make() for _ in range(rotation_count(moved) - 1)]
        seconds = time_graph(lambda i, out=out: out.fill_(1.0), len(weights))
        rows.append({"shape": label, "N": n, "K": k, "variant": {"store_only": True}, "us": seconds * 1e6,
                     "bytes": moved, "pct_copy": 100 * moved / seconds / bandwidth})
        print(f"{label} store only: {seconds * 1e6:.1f} us, {rows[-1]['pct_copy']:.0f} % of copy", flush=True)

        for variant in variants or [{}]:
            def dequantize(i, weights=weights, out=out, variant=variant):
                q = weights[i]
                kernel.triton_kernels.dequantize(q.qweight, q.scales, q.zeros, q.codebook, n, k, q.group_size,
                                                 torch.float16, out=out, **variant)

            seconds = time_graph(dequantize, len(weights))
            rows.append({"shape": label, "N": n, "K": k, "variant": variant, "us": seconds * 1e6, "bytes": moved,
                         "pct_copy": 100 * moved / seconds / bandwidth})
            print(f"{label} {json.dumps(variant)}: dequantize {seconds * 1e6:.1f} us, {rows[-1]['pct_copy']:.0f} % "
                  "of copy", flush=True)
        del weights, out
    return {"env": environment(), "copy_bandwidth": bandwidth, "fmt": fmt, "group": group, "rows": rows}


def sustained(kernel, shapes=SHAPES[:4], tokens=(4096,), seconds: float = 2.5, settle: float = 0.3,
              log: Callable[[str], None] = print) -> dict:
    """The shipped launch and cuBLAS fp16 each replayed back to back for `seconds` (`sustained_replays`, after a
    second idle so that each starts from the same cool card) while `ClockLog` samples the clocks: per phase the
    first replay's time per call, the median after `settle` seconds, and the median SM clock and power over the
    same span. Tells whether a gap to cuBLAS at large M is the clocks the power cap leaves each kernel, or the
    kernel's work per clock (docs/design/w4a16.md, run 139). int4 g128 symmetric, fp16 x, verified first."""
    rows = []
    with ClockLog() as clocks:
        warm_clocks()
        for label, k, n in shapes:
            shape = _Shape(kernel, k, n)
            dense16 = shape.dense_copies(torch.float16)
            for m in tokens:
                xs = _inputs(m, k, torch.float16, max(shape.copies, len(dense16)))
                config = dict(kernel.tuning.select(m, n, k, torch.device("cuda")))

                def ours(i):
                    q = shape.qws[i % shape.copies]
                    return kernel.triton_kernels.matmul(xs[i], q.qweight, q.scales, q.zeros, q.codebook, None, n, k,
                                                        GROUP, config)

                def dense(i):
                    return F.linear(xs[i], dense16[i % len(dense16)])

                ref = shape.reference(xs[0])
                for impl, fn in (("shipped", ours), ("cublas-float16", dense)):
                    err = _verified(fn(0), ref, torch.float16, f"{label} M={m} {impl}: ")
                    torch.cuda.synchronize()
                    time.sleep(1.0)
                    start = time.time()
                    replays = sustained_replays(fn, len(xs), seconds)
                    steady = [us for t, us in replays if t >= settle]
                    samples = clocks.between(start + settle, time.time())
                    rows.append({"shape": label, "N": n, "K": k, "m": m, "impl": impl,
                                 "config": config if impl == "shipped" else None, "rel_err": err,
                                 "us_first": replays[0][1] * 1e6, "us_sustained": statistics.median(steady) * 1e6,
                                 "replays": len(replays), "samples": len(samples),
                                 "sm_mhz": statistics.median(x["sm_mhz"] for x in samples) if samples else None,
                                 "power_w": statistics.median(x["power_w"] for x in samples) if samples else None,
                                 "reasons": sorted({x["reasons"] for x in samples})})
                    r = rows[-1]
                    log(f"{label} M={m} {impl}: first {r['us_first']:.1f} us, sustained {r['us_sustained']:.1f} us at "
                        f"{r['sm_mhz']} MHz, {r['power_w']} W")
            del shape, dense16
            torch.cuda.empty_cache()
    return {"env": environment(), "seconds": seconds, "settle": settle, "rows": rows}


def load_speed(kernel, folder, *, layers: int = 8, n: int = 4096, k: int = 4096, group: int = 128,
               device: str = "cpu", repeats: int = 3) -> dict:
    """The loader against the read: a GPTQ checkpoint of `layers` random [n, k] linears (int4 g128 symmetric, v1
    zeros, no act-order) written to `folder`, then the best of `repeats` times of (a) reading every tensor with
    safetensors and copying it to `device`, (b) `load_checkpoint` into a model of those linears built on the
    meta device beforehand (reading included; building the model is the caller's, outside the time). The
    issue's goal: (b) no more than (a). The first time of each is reported too: on a GPU the loader's first
    call also allocates the pinned staging memory that later calls reuse."""
    import os

    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(layers):
        tensors[f"layers.{i}.qweight"] = torch.randint(-2**31, 2**31, (k // 8, n), generator=g, dtype=torch.int32)
        tensors[f"layers.{i}.qzeros"] = torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32)
        tensors[f"layers.{i}.scales"] = (torch.rand(k // group, n, generator=g) * 1e-2).half()
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "quantize_config.json"), "w") as f:
        json.dump({"bits": 4, "group_size": group, "desc_act": False, "sym": True, "checkpoint_format": "gptq"}, f)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def read():  # a copy, so the bytes are read (get_tensor alone may map the file without touching them)
        with safe_open(os.path.join(folder, "model.safetensors"), framework="pt", device="cpu") as handle:
            return [handle.get_tensor(name).to(device, copy=True) for name in handle.keys()]

    def meta_model():
        with torch.device("meta"):
            model = torch.nn.Module()
            model.layers = torch.nn.ModuleList(torch.nn.Linear(k, n, bias=False) for _ in range(layers))
        return model

    def load(model):
        return kernel.load_checkpoint(model, folder, device=device, dtype=torch.float16)

    def timed(fn, setup=lambda: ()) -> list[float]:
        times = []
        for _ in range(repeats):
            args = setup()
            sync()
            start = time.perf_counter()
            fn(*args)
            sync()
            times.append(time.perf_counter() - start)
        return times

    reads, loads = timed(read), timed(load, lambda: (meta_model(),))
    read_s, load_s = min(reads), min(loads)
    weights = layers * n * k
    return {"kernel": "w4a16", "env": environment(), "mode": "load-speed", "device": device,
            "rows": [{"case": f"GPTQ int4 g{group}, {layers} x [{n}, {k}]", "bytes": nbytes,
                      "read_seconds": read_s, "load_seconds": load_s, "load_over_read": load_s / read_s,
                      "read_first_seconds": reads[0], "load_first_seconds": loads[0],
                      "load_ns_per_weight": load_s / weights * 1e9, "read_ns_per_weight": read_s / weights * 1e9}]}


def main(argv: list[str] | None = None) -> int:
    """`python -m hubtools.bench.w4a16 --out tune.json [--shapes LABEL ...] [--tokens M ...]`: build the
    kernel, run `tune`, and write the launch table (``shapes``) with every trial and the environment."""
    import argparse
    import json
    from pathlib import Path

    from ..build import loaded_kernel
    from ..workspace import Workspace

    parser = argparse.ArgumentParser(prog="python -m hubtools.bench.w4a16", description=main.__doc__)
    parser.add_argument("--out", type=Path, help="the results file (every mode but --merge-result)")
    parser.add_argument("--shapes", nargs="*", default=None,
                        help="shape labels (default: the Llama-3 shapes for the sweep; every shape for --compare-decode)")
    parser.add_argument("--tokens", nargs="*", type=int, default=None,
                        help="the M to time (default 1 16 64 256 1024); with --merge-result of a results bench, the M "
                             "to merge (default every one)")
    parser.add_argument("--table", type=Path, help="also write the launch table the kernel ships here (with "
                        "--compare-decode: merge the winners that beat the shipped configs, see merge_compare)")
    parser.add_argument("--code", type=Path, help="write the winning M=1 / M=16 kernels' TTGIR, PTX, cubin here")
    parser.add_argument("--decode-run", action="store_true",
                        help="instead of the sweep: the benchmark (`run`) at M=1 only, Llama-3 and Qwen2.5-1.5B "
                             "shapes, written as a results file (e.g. docs/design/w4a16/run6-w4a16-m1-results.json)")
    parser.add_argument("--compare-decode", action="store_true",
                        help="instead of the sweep: shipped config vs decode-path candidates vs cuBLAS at --tokens "
                             "(compare_decode; Llama-3, Qwen2.5-1.5B and untuned shapes, or --shapes)")
    parser.add_argument("--configs", help="--compare-decode's launch table for this card: a table file standing in "
                        "for the card's own (e.g. configs/nvidia-h200.json on an H100), or 'none' for the heuristic "
                        "(see stand_in_table)")
    parser.add_argument("--merge-result", type=Path, help="merge a --compare-decode result file written earlier into "
                        "--table's file (merge_compare; the file's own env and command go with it), timing nothing; "
                        "or a results bench (scripts/bench.py w4a16), whose heuristic rows are then the candidates "
                        "(bench_as_compare)")
    parser.add_argument("--min-gain", type=float, default=0.03,
                        help="merge a winner only where it beats the shipped launch by more than this share (default "
                             "0.03, one pass's noise; interleaved --rounds resolve ~0.01)")
    parser.add_argument("--fmt", choices=("int4", "nf4"), default="int4", help="--compare-decode's weight format")
    parser.add_argument("--group", type=int, default=GROUP, help="--compare-decode's group size")
    parser.add_argument("--bf16", action="store_true", help="--compare-decode with bf16 activations (and cuBLAS "
                        "bf16); default fp16")
    parser.add_argument("--zero-point", action="store_true", help="--compare-decode's int4 with integer zero points "
                        "(default: symmetric, as the results bench)")
    parser.add_argument("--variants", help="--compare-decode times, instead of its candidates, the shipped config "
                        "with each of these overrides (a JSON list of dicts); --dequant-bandwidth times the "
                        "dequantize kernel with each as its keyword arguments")
    parser.add_argument("--rounds", type=int, help="--compare-decode: time the shipped config, the candidates and "
                        "cuBLAS again in this many interleaved rounds, each row the median (for A / B differences of "
                        "a few percent)")
    parser.add_argument("--sustained", type=float, metavar="SECONDS",
                        help="instead of the sweep: the shipped launch and cuBLAS each replayed for SECONDS with the "
                             "clocks and power sampled (sustained), --shapes at --tokens")
    parser.add_argument("--dequant-bandwidth", action="store_true",
                        help="instead of the sweep: the dequantize kernel's time and share of copy bandwidth "
                             "(dequant_bandwidth) on the Llama-3 shapes or --shapes, --fmt, --group")
    parser.add_argument("--compare-gemv", action="store_true",
                        help="instead of the sweep: M=1 fp32 GEMV vs packed-fp16 GEMV candidates vs cuBLAS "
                             "(compare_gemv)")
    parser.add_argument("--load-speed", metavar="DEVICE",
                        help="instead of the sweep: load_checkpoint of a synthetic GPTQ checkpoint onto DEVICE "
                             "(cpu, cuda) against reading its tensors (load_speed)")
    args = parser.parse_args(argv)
    known = {s[0] for s in SHAPES + QWEN_SHAPES + OTHER_SHAPES}
    if args.shapes is not None and not set(args.shapes) <= known:
        parser.error(f"unknown --shapes {sorted(set(args.shapes) - known)}; known: {sorted(known)}")
    if args.zero_point and args.fmt != "int4":
        parser.error("--zero-point applies to --fmt int4 only")
    project = Workspace.load().kernel("w4a16")
    if args.load_speed:
        import tempfile

        with loaded_kernel(project) as module, tempfile.TemporaryDirectory() as folder:
            results = load_speed(module, folder, device=args.load_speed)
        results["env"]["command"] = f"python -m hubtools.bench.w4a16 --load-speed {args.load_speed} --out {args.out}"
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps(results["rows"], indent=1))
        return 0
    if args.decode_run:
        with loaded_kernel(project) as module:
            results = run(module, shapes=SHAPES + QWEN_SHAPES, tokens=(1,), bf16_shapes=())
        results["env"]["command"] = "python -m hubtools.bench.w4a16 --decode-run --out " + str(args.out)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")
        return 0
    if args.merge_result:
        if not args.table:
            parser.error("--merge-result needs --table (the table to merge into)")
        compared = json.loads(args.merge_result.read_text())
        if "kernel" in compared:  # a results bench, not a compare
            with loaded_kernel(project) as module:
                compared = bench_as_compare(compared, json.loads(args.table.read_text()),
                                            module.tuning.tuned_config, args.tokens)
        _merge_into(args.table, compared, args.min_gain)
        return 0
    if args.tokens is None:
        args.tokens = [1, 16, 64, 256, 1024]
    if args.out is None:
        parser.error("--out is required")
    if args.compare_decode:
        every = SHAPES + QWEN_SHAPES + OTHER_SHAPES
        chosen = every if args.shapes is None else tuple(s for s in every if s[0] in args.shapes)
        with loaded_kernel(project) as module:
            if args.configs:
                stand_in_table(module, torch.cuda.get_device_name(), None if args.configs == "none" else args.configs)
            compared = compare_decode(module, shapes=chosen, tokens=tuple(args.tokens), out_path=args.out,
                                      fmt=args.fmt, group=args.group, zero_point=args.zero_point,
                                      x_dtype=torch.bfloat16 if args.bf16 else torch.float16,
                                      variants=None if args.variants is None else json.loads(args.variants),
                                      rounds=args.rounds)
        print(f"wrote {args.out}")
        if args.table:
            _merge_into(args.table, compared, args.min_gain)
        return 0
    if args.sustained:
        with loaded_kernel(project) as module:
            measured = sustained(module, [s for s in SHAPES if args.shapes is None or s[0] in args.shapes],
                                 tuple(args.tokens), args.sustained)
        args.out.write_text(json.dumps(measured, indent=1) + "\n")
        print(f"wrote {args.out}")
        return 0
    if args.dequant_bandwidth:
        with loaded_kernel(project) as module:
            measured = dequant_bandwidth(module, [s for s in SHAPES if args.shapes is None or s[0] in args.shapes],
                                         args.fmt, args.group,
                                         None if args.variants is None else json.loads(args.variants))
        args.out.write_text(json.dumps(measured, indent=1) + "\n")
        print(f"wrote {args.out}")
        return 0
    if args.compare_gemv:
        with loaded_kernel(project) as module:
            compared = compare_gemv(module, out_dir=args.out.parent)
        args.out.write_text(json.dumps(compared, indent=1) + "\n")
        print(f"wrote {args.out}")
        return 0
    with loaded_kernel(project) as module:
        tuned = tune(module, [s for s in SHAPES if args.shapes is None or s[0] in args.shapes], tuple(args.tokens))
    code = tuned.pop("code")
    env = environment()
    tuned["env"] = env
    tuned["device"] = env["gpu"]
    args.out.write_text(json.dumps(tuned, indent=1) + "\n")
    print(f"wrote {args.out}")
    if args.table:  # merged into an existing table: entries of shapes and M buckets not swept here stay
        table = json.loads(args.table.read_text()) if args.table.exists() else {"shapes": {}, "heuristic": {}}
        table["device"] = env["gpu"]
        table.setdefault("measured", []).append({k: env[k] for k in ("date", "torch", "triton", "cuda", "command")})
        table["heuristic"].update(tuned["heuristic"])
        for shape, entry in tuned["shapes"].items():
            table["shapes"].setdefault(shape, {}).update(entry)
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.table}")
    if args.code:
        import io
        import tarfile

        with tarfile.open(args.code, "w:gz") as tar:
            for m, kinds in code.items():
                for kind, text in kinds.items():
                    data = text if isinstance(text, bytes) else text.encode()
                    info = tarfile.TarInfo(f"m{m}.{kind}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
