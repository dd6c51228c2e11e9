"""Entry points behind scripts/bench.py and scripts/report.py."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

from ..workspace import REPO_ROOT, Workspace

DOCS = REPO_ROOT / "docs" / "benchmarks"


def bench_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py", description="Benchmark built kernels on the GPU.")
    parser.add_argument("kernels", nargs="+", help="kernel names, e.g. rmsnorm")
    parser.add_argument("--out-dir", type=Path, default=DOCS, help="where <kernel>-results.json goes")
    args = parser.parse_args(argv)

    import kernels

    from ..build import build_kernel

    workspace = Workspace.load()
    with tempfile.TemporaryDirectory() as tmp:
        for project in workspace.kernels(args.kernels):
            module = kernels.get_local_kernel(build_kernel(project, Path(tmp)) / "build")
            cases = importlib.import_module(f"hubtools.bench.{project.python_name}")
            results = cases.run(module)
            args.out_dir.mkdir(parents=True, exist_ok=True)
            path = args.out_dir / f"{project.name}-results.json"
            path.write_text(json.dumps(results, indent=1) + "\n")
            print(f"{project.name}: wrote {path}")
    return 0


def report_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="report.py", description="Results files -> docs/benchmarks/*.md + PNG.")
    parser.add_argument("results", nargs="*", type=Path, help="results files (default: docs/benchmarks/*-results.json)")
    args = parser.parse_args(argv)

    from .report import write_report

    files = args.results or sorted(DOCS.glob("*-results.json"))
    if not files:
        print("no results files; run scripts/bench.py on a GPU first", file=sys.stderr)
        return 1
    for file in files:
        print(f"wrote {write_report(file, DOCS)}")
    return 0
