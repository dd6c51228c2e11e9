"""The entry point behind scripts/bench.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..build import loaded_kernel
from ..workspace import REPO_ROOT, Workspace
from . import BENCHMARKS

DOCS = REPO_ROOT / "docs" / "benchmarks"


def bench_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py", description="Benchmark built kernels on the GPU.")
    parser.add_argument("kernels", nargs="+", help="kernel names, e.g. rmsnorm")
    parser.add_argument("--out-dir", type=Path, default=DOCS, help="where <kernel>-results.json goes")
    parser.add_argument("--ep", nargs="?", const="auto", metavar="WORLD_SIZES",
                        help="moe-dispatch only: expert parallelism over NCCL, one process per GPU of this host, "
                             "at world sizes 2,4,8 as far as there are GPUs (or those given, e.g. --ep 2,4); "
                             "writes moe-dispatch-ep-results.json")
    args = parser.parse_args(argv)
    if args.ep is not None:
        return _bench_ep(parser, args)

    for project in Workspace.load().kernels(args.kernels):
        with loaded_kernel(project) as module:
            results = BENCHMARKS[project.name].run(module)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"{project.name}-results.json"
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"{project.name}: wrote {path}")
    return 0


def _bench_ep(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`bench.py moe-dispatch --ep`: checks the host first (>= 2 GPUs), then builds and runs the EP benchmark."""
    import tempfile

    import torch

    from ..build import build_kernel
    from . import moe_dispatch

    if args.kernels != ["moe-dispatch"]:
        parser.error("--ep is the moe-dispatch expert-parallel benchmark: python scripts/bench.py moe-dispatch --ep")
    try:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        world_sizes = moe_dispatch.ep_world_sizes(args.ep, gpus)
    except ValueError as exc:
        parser.error(str(exc))
    (project,) = Workspace.load().kernels(args.kernels)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{moe_dispatch.EP_RESULTS_NAME}-results.json"
    old = json.loads(path.read_text()) if path.exists() else None  # rows of other world sizes are kept

    def write(results: dict) -> None:  # after each world size
        path.write_text(json.dumps(moe_dispatch.merge_ep_results(old, results), indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        moe_dispatch.run_ep(build_kernel(project, Path(tmp)), world_sizes, progress=write)
    print(f"moe-dispatch --ep: wrote {path}")
    return 0
