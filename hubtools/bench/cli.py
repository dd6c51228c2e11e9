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
    args = parser.parse_args(argv)

    for project in Workspace.load().kernels(args.kernels):
        with loaded_kernel(project) as module:
            results = BENCHMARKS[project.name].run(module)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"{project.name}-results.json"
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"{project.name}: wrote {path}")
    return 0
