"""RMSNorm benchmark cases and the sweep behind the kernel's launch table.

`run(kernel)`: bf16 forward and fused residual-add RMSNorm for H in HIDDEN x M in ROWS, and backward for
H in BACKWARD_HIDDEN x M in BACKWARD_ROWS, each against `torch.compile` of the same formula (one static
compilation per shape, checked to be a real compilation) and eager PyTorch, all in the same process.
Every timed output is first checked against a float64 reference. Bytes are what the op must move once:
read x (+ residual) and the weight, write y (+ x + residual); backward reads x, dy and the weight and
writes dx and dw.

`tune(kernel)`: times the candidate launch shapes of `TUNE_SPACE` / `BACKWARD_TUNE_SPACE` through the
kernel's launchers on the benchmark's goal shapes and returns the table the kernel ships for this GPU as
`configs/<gpu>.json` (per row block, the candidate with the least time relative to the best on each shape;
row blocks outside the sweep are left to the kernel's heuristic).
"""

from __future__ import annotations

import json
from typing import Callable

import torch
import torch.nn.functional as F

from ..measure import environment, measure_copy_bandwidth, measure_matmul_flops, rotation_count, time_graph, warm_clocks

HIDDEN = (2048, 4096, 7168, 8192, 16384)
ROWS = (1, 16, 128, 4096, 16384)
BACKWARD_HIDDEN = (4096, 7168, 8192)
BACKWARD_ROWS = (4096, 16384)
GOAL_ROWS = 4096  # the bandwidth goals hold from this many rows up
EPS = 1e-6
DTYPE = torch.bfloat16
BYTES = 2  # bf16

# Row block -> candidate launches for the sweep; rows-per-program > 1 only where a row is short.
def _space(rows, warps, evict_first=(True,)):
    return [{"rows": r, "num_warps": w, "evict_first": e} for r in rows for w in warps for e in evict_first]


TUNE_SPACE = {
    1024: _space((2, 4), (4, 8)),
    2048: _space((1, 2), (4, 8), (True, False)),
    4096: _space((1, 2), (4, 8, 16), (True, False)),
    8192: _space((1, 2), (8, 16, 32), (True, False)),
    16384: _space((1,), (8, 16, 32), (True, False)),
    32768: _space((1,), (16, 32)),
}
BACKWARD_TUNE_SPACE = {
    1024: [{"rows": r, "num_warps": w} for r in (2, 4) for w in (4, 8)],
    2048: [{"rows": r, "num_warps": w} for r in (1, 2) for w in (4, 8)],
    4096: [{"rows": 1, "num_warps": w} for w in (8, 16)],
    8192: [{"rows": 1, "num_warps": w} for w in (16, 32)],
    16384: [{"rows": 1, "num_warps": w} for w in (16, 32)],
}
BACKWARD_PROGRAMS_PER_SM = (1, 2, 4)
TUNE_ROWS = (GOAL_ROWS, 16384)


def tune_problems(block: int) -> list[tuple[int, int]]:
    """(H, M) each candidate for a row block is timed on: the benchmark's hidden sizes that use the block
    (e.g. 7168 and 8192 for 8192), or the block itself, at the goal row counts."""
    hidden = [h for h in HIDDEN if 1 << (h - 1).bit_length() == block] or [block]
    return [(h, m) for h in hidden for m in TUNE_ROWS]


# The formulas the baselines compute: transformers' LlamaRMSNorm, and the residual add before it.
def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_llama_rms_norm(x, residual, weight, eps):
    total = x + residual
    return llama_rms_norm(total, weight, eps), total


def llama_rms_norm_backward(grad_out, x, weight, eps):
    """(dx, dw) of llama_rms_norm, written out so Inductor can fuse it like the forward."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    g = grad_out.float() * weight.float()
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (grad_out.float() * xhat.to(x.dtype).float()).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def eager_rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def eager_add_rms_norm(x, residual, weight, eps):
    total = x + residual
    return F.rms_norm(total, (x.shape[-1],), weight, eps), total


def _reference(x, weight, eps, residual=None):
    """float64 (out, total) with LlamaRMSNorm's rounding of the normalized value."""
    total = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    xd = total.double()
    xhat = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return weight.double() * xhat.to(x.dtype).double(), total


def _reference_backward(grad_out, x, weight, eps):
    x64 = x.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    out = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return torch.autograd.grad(out, (x64, w64), grad_out.double())


def _check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Two bf16 ulps; F.rms_norm rounds once after the weight multiply, so allow it the same."""
    torch.testing.assert_close(got.double(), want.double(), rtol=2 * torch.finfo(DTYPE).eps, atol=1e-2,
                               msg=lambda m: f"{name}: output differs from the float64 reference\n{m}")


def _check_relative(name: str, got: torch.Tensor, want: torch.Tensor, limit: float = 1e-2) -> None:
    error = ((got.double() - want).norm() / want.norm()).item()
    if not error < limit:
        raise AssertionError(f"{name}: relative error {error:.2e} against the float64 reference")


def _compile(fn: Callable, *example) -> Callable:
    """`torch.compile(fn)` specialised to these shapes, with a check that Dynamo compiled a new graph
    (past its recompile limit it would silently run eager)."""
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)
    compiled(*example)
    if counters["stats"]["unique_graphs"] != before + 1:
        raise RuntimeError(f"torch.compile did not compile {fn.__name__} for shapes {[tuple(t.shape) for t in example[:2]]}")
    return compiled


def _weight(h: int) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(h, device="cuda")).to(DTYPE)


def _rows(case: str, times: dict[str, float], nbytes: int, baseline: str) -> list[dict]:
    return [
        {"case": case, "impl": impl, "seconds": seconds, "bytes": nbytes, "flops": 0,
         **({"baseline": baseline} if impl == "ours" else {})}
        for impl, seconds in times.items()
    ]


def forward_case(k, h: int, m: int, fused: bool) -> list[dict]:
    nbytes = (4 if fused else 2) * m * h * BYTES + h * BYTES
    n = rotation_count(nbytes)
    xs = [torch.randn(m, h, device="cuda", dtype=DTYPE) for _ in range(n)]
    rs = [torch.randn(m, h, device="cuda", dtype=DTYPE) for _ in range(n)] if fused else None
    w = _weight(h)
    if fused:
        compiled = _compile(add_llama_rms_norm, xs[0], rs[0], w, EPS)
        impls = {
            "ours": lambda i: k.fused_add_rms_norm(xs[i], rs[i], w, EPS),
            "torch.compile": lambda i: compiled(xs[i], rs[i], w, EPS),
            "eager": lambda i: eager_add_rms_norm(xs[i], rs[i], w, EPS),
        }
        want_out, want_total = _reference(xs[0], w, EPS, rs[0])
        for name, fn in impls.items():
            out, total = fn(0)
            _check(name, out, want_out)
            _check(f"{name} (x + residual)", total, want_total)
    else:
        compiled = _compile(llama_rms_norm, xs[0], w, EPS)
        impls = {
            "ours": lambda i: k.rms_norm(xs[i], w, EPS),
            "torch.compile": lambda i: compiled(xs[i], w, EPS),
            "eager": lambda i: eager_rms_norm(xs[i], w, EPS),
        }
        want_out, _ = _reference(xs[0], w, EPS)
        for name, fn in impls.items():
            _check(name, fn(0), want_out)
    times = {name: time_graph(fn, n) for name, fn in impls.items()}
    label = f"{'fused_add' if fused else 'rms_norm'} H={h} M={m}"
    return _rows(label, times, nbytes, "torch.compile")


def backward_case(k, h: int, m: int) -> list[dict]:
    nbytes = 3 * m * h * BYTES + 2 * h * BYTES
    n = rotation_count(nbytes)
    xs = [torch.randn(m, h, device="cuda", dtype=DTYPE) for _ in range(n)]
    dys = [torch.randn(m, h, device="cuda", dtype=DTYPE) for _ in range(n)]
    w = _weight(h)
    compiled = _compile(llama_rms_norm_backward, dys[0], xs[0], w, EPS)
    impls = {
        "ours": lambda i: k.ops.rms_norm_backward(dys[i], xs[i], w, None, EPS, 0.0, True),
        "torch.compile": lambda i: compiled(dys[i], xs[i], w, EPS),
        "eager": lambda i: llama_rms_norm_backward(dys[i], xs[i], w, EPS),
    }
    want_dx, want_dw = _reference_backward(dys[0], xs[0], w, EPS)
    for name, fn in impls.items():
        dx, dw = fn(0)
        _check_relative(f"{name} dx", dx, want_dx)
        _check_relative(f"{name} dw", dw, want_dw)
    times = {name: time_graph(fn, n) for name, fn in impls.items()}
    return _rows(f"backward H={h} M={m}", times, nbytes, "torch.compile")


def goals(results: dict) -> list[dict]:
    """The issue's goals, evaluated on the measured rows: one entry per (goal, case)."""
    by_case: dict[str, dict[str, dict]] = {}
    for row in results["rows"]:
        by_case.setdefault(row["case"], {})[row["impl"]] = row
    copy_bandwidth = results["copy_bandwidth"]
    targets = {"rms_norm": (92.0, 1.05), "fused_add": (93.0, 1.05), "backward": (80.0, None)}
    out = []
    for case, impls in by_case.items():
        op, m = case.split()[0], int(case.split("M=")[1])
        ours, compiled = impls["ours"], impls["torch.compile"]
        speedup = compiled["seconds"] / ours["seconds"]
        if m < GOAL_ROWS:
            out.append({"goal": "decode: torch.compile time / ours", "case": case, "value": speedup, "target": 1.0,
                        "met": speedup >= 1.0})
            continue
        pct_goal, speedup_goal = targets[op]
        pct = 100 * ours["bytes"] / ours["seconds"] / copy_bandwidth
        out.append({"goal": f"{op}: % of copy bandwidth", "case": case, "value": pct, "target": pct_goal,
                    "met": pct >= pct_goal})
        if speedup_goal:
            out.append({"goal": f"{op}: speed-up vs torch.compile", "case": case, "value": speedup,
                        "target": speedup_goal, "met": speedup >= speedup_goal})
    return out


NOTES = [f"Decode cases (M < {GOAL_ROWS}) rotate at most 64 input sets, so their inputs can stay in L2; both "
         "implementations are timed the same way."]


def _configure_dynamo() -> None:
    # One compilation per shape: raise the limits so no case silently falls back to eager, and fail loudly if hit.
    torch._dynamo.config.recompile_limit = 4096
    torch._dynamo.config.accumulated_recompile_limit = 1 << 16
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def run(kernel_module, *, hidden=HIDDEN, rows=ROWS, backward_hidden=BACKWARD_HIDDEN,
        backward_rows=BACKWARD_ROWS, progress: Callable[[dict], None] | None = None) -> dict:
    """All cases; `progress(results)` is called after each case with the results so far."""
    _configure_dynamo()
    torch.manual_seed(0)
    warm_clocks()
    results = {
        "kernel": "rmsnorm",
        "env": environment(),
        "copy_bandwidth": measure_copy_bandwidth(),
        "matmul_flops": measure_matmul_flops(),
        "rows": [],
    }
    cases = [(forward_case, (h, m, fused)) for fused in (False, True) for h in hidden for m in rows]
    cases += [(backward_case, (h, m)) for h in backward_hidden for m in backward_rows]
    for case, args in cases:
        results["rows"] += case(kernel_module, *args)
        torch.cuda.empty_cache()
        if progress:
            progress(results)
    results["notes"] = NOTES
    return results


def _pick(timed: list[tuple[list[float], dict]]) -> dict:
    """The candidate with the least summed time relative to the best on each problem."""
    best = [min(times[i] for times, _ in timed) for i in range(len(timed[0][0]))]
    return min(timed, key=lambda t: sum(s / b for s, b in zip(t[0], best)))[1]


def tune(kernel_module) -> dict:
    """This GPU's launch table (configs/<gpu>.json) with each single-block entry of TUNE_SPACE /
    BACKWARD_TUNE_SPACE set to its best candidate, timed through the kernel's launchers on each of
    `tune_problems`, and the run appended to its provenance."""
    launchers = kernel_module.ops.triton_kernels
    gpu = torch.cuda.get_device_name()
    table = json.loads(json.dumps(launchers.tuned_table(gpu))) or {"measured": []}
    torch.manual_seed(0)
    warm_clocks()
    log = []
    for kind, space in (("forward", TUNE_SPACE), ("fused_add", TUNE_SPACE), ("backward", BACKWARD_TUNE_SPACE)):
        for block, candidates in space.items():
            if kind == "backward":
                candidates = [{**c, "programs_per_sm": p} for c in candidates for p in BACKWARD_PROGRAMS_PER_SM]
            timed = [([], config) for config in candidates]
            for h, m in tune_problems(block):
                launch, check, n = _tune_problem(launchers, kind, h, m)
                for times, config in timed:
                    cfg = {"looped": False, "block": block, **config}
                    times.append(time_graph(lambda i, c=cfg: launch(i, c), n))
                    launch(0, cfg)  # dw is shared by the rotated inputs: recompute it for input 0
                    check(f"tune {kind} {cfg}")
                del launch, check
                torch.cuda.empty_cache()
            table.setdefault(kind, {})[str(block)] = _pick(timed)
            log.append({"kind": kind, "block": block, "problems": tune_problems(block),
                        "candidates": [{**c, "us": [t * 1e6 for t in times]} for times, c in timed]})
    env = environment(["-m", "hubtools.bench.rmsnorm", "tune"])
    table["device"] = gpu
    table["measured"].append({"command": env["command"], "date": env["date"],
                              "problems": f"bf16, H in {HIDDEN} (or the row block) x M in {TUNE_ROWS}",
                              **{k: env[k] for k in ("torch", "triton", "cuda")}})
    return {"table": table, "log": log}


def _tune_problem(launchers, kind: str, h: int, m: int):
    """(launch(i, config), check(name), n_inputs) over rotated bf16 inputs of m rows of h."""
    n = rotation_count({"forward": 2, "fused_add": 4, "backward": 3}[kind] * m * h * BYTES)
    xs = [torch.randn(m, h, device="cuda", dtype=DTYPE) for _ in range(n)]
    w = _weight(h)
    if kind == "backward":
        dys = [torch.randn_like(xs[0]) for _ in range(n)]
        dxs = [torch.empty_like(xs[0]) for _ in range(n)]
        dw = torch.empty_like(w)
        want_dx, want_dw = _reference_backward(dys[0], xs[0], w, EPS)

        def launch(i, config):
            launchers.backward(dys[i], xs[i], w, None, dxs[i], dw, EPS, 0.0, config=config)

        def check(name):
            _check_relative(f"{name} dx", dxs[0], want_dx)
            _check_relative(f"{name} dw", dw, want_dw)

        return launch, check, n
    fused = kind == "fused_add"
    rs = [torch.randn_like(xs[0]) for _ in range(n)] if fused else [None] * n
    outs = [torch.empty_like(xs[0]) for _ in range(n)]
    totals = [torch.empty_like(xs[0]) for _ in range(n)] if fused else [None] * n
    want, _ = _reference(xs[0], w, EPS, rs[0])

    def launch(i, config):
        launchers.forward(xs[i], rs[i], w, outs[i], totals[i], EPS, 0.0, config=config)

    def check(name):
        _check(name, outs[0], want)

    return launch, check, n


def format_configs(table: dict) -> str:
    """configs/<gpu>.json text: one line per run and per entry, so diffs of a re-tune stay readable."""
    measured = ",\n".join(f"  {json.dumps(run)}" for run in table["measured"])
    parts = [f' "device": {json.dumps(table["device"])}', f' "measured": [\n{measured}\n ]']
    for kind in ("forward", "fused_add", "backward"):
        body = ",\n".join(f"  {json.dumps(block)}: {json.dumps(entry)}" for block, entry in table[kind].items())
        parts.append(f" {json.dumps(kind)}: {{\n{body}\n }}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m hubtools.bench.rmsnorm tune` rewrites this GPU's configs/<gpu>.json from a sweep;
    `python -m hubtools.bench.rmsnorm run --out FILE [--goal-sizes]` writes results as cases finish."""
    import argparse
    import pathlib

    from ..build import loaded_kernel
    from ..workspace import Workspace

    parser = argparse.ArgumentParser(prog="python -m hubtools.bench.rmsnorm")
    sub = parser.add_subparsers(dest="command", required=True)
    tune_parser = sub.add_parser("tune", help="sweep launch shapes, rewrite configs/<gpu>.json")
    tune_parser.add_argument("--log", type=pathlib.Path, help="also write every candidate's time here")
    run_parser = sub.add_parser("run", help="benchmark cases and baselines")
    run_parser.add_argument("--out", type=pathlib.Path, required=True)
    run_parser.add_argument("--goal-sizes", action="store_true", help=f"only M >= {GOAL_ROWS} and backward")
    args = parser.parse_args(argv)
    with loaded_kernel(Workspace.load().kernel("rmsnorm")) as kernel:
        if args.command == "tune":
            tuned = tune(kernel)
            # The table goes into the source tree, under the name the kernel looks it up by.
            name = kernel.ops.triton_kernels.config_path(tuned["table"]["device"]).name
            source = Workspace.load().kernel("rmsnorm").package_dir / "configs" / name
            source.write_text(format_configs(tuned["table"]))
            if args.log:
                args.log.write_text(json.dumps(tuned["log"], indent=1) + "\n")
            print(f"wrote {source}")
            return 0
        rows = tuple(m for m in ROWS if m >= GOAL_ROWS) if args.goal_sizes else ROWS

        def progress(results):
            args.out.write_text(json.dumps(results, indent=1) + "\n")
            last = results["rows"][-1]
            print(f"{last['case']}: " + ", ".join(
                f"{r['impl']} {r['seconds'] * 1e6:.1f} µs {100 * r['bytes'] / r['seconds'] / results['copy_bandwidth']:.1f}%"
                for r in results["rows"] if r["case"] == last["case"]))

        progress_results = run(kernel, rows=rows, progress=progress)
        progress_results["env"]["command"] = "python -m hubtools.bench.rmsnorm run" + (" --goal-sizes" if args.goal_sizes else "")
        args.out.write_text(json.dumps(progress_results, indent=1) + "\n")
        goal_list = goals(progress_results)
        print(f"{sum(g['met'] for g in goal_list)} of {len(goal_list)} goals met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
