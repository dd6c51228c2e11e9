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
    parser = argparse.ArgumentParser(
        prog="report.py",
        description="docs/benchmarks/<kernel>-results.json -> docs/benchmarks/<kernel>.md + PNG, docs/RESULTS.md, "
                    "and the headline table in README.md.")
    parser.parse_args(argv)

    from . import report

    workspace = Workspace.load()
    # <kernel>-results.json is the full benchmark; <kernel>-<run>-results.json files are narrower later runs.
    all_results = []
    for name in workspace.members:
        paths = sorted(DOCS.glob(f"{name}*-results.json"), key=lambda p: (p.name != f"{name}-results.json", p.name))
        all_results += [r for r in map(report.load, paths) if r.get("kernel") == name]
    if not all_results:
        print("no results files; run scripts/bench.py on a GPU first", file=sys.stderr)
        return 1
    for results in all_results:
        print(f"wrote {report.write_kernel_page(results, DOCS)}")
    plot = DOCS / "package-roofline.png"
    report.package_plot(all_results, plot)
    sections, e2e_goals = [], {}
    decode_file = DOCS / "e2e-decode-results.json"
    if decode_file.exists():
        from ..e2e.decode import goals as decode_goals

        decode = report.load(decode_file)
        decode_plot = DOCS / "e2e-decode.png"
        report.decode_plot(decode, decode_plot)
        e2e_goals["decode (e2e)"] = decode_goals(decode)
        sections += report.decode_section(decode, e2e_goals["decode (e2e)"], f"benchmarks/{decode_plot.name}")
    for smollm2_file in sorted(DOCS.glob("e2e-smollm2-*results.json")):
        smollm2 = report.load(smollm2_file)
        e2e_goals[f"SmolLM2 (e2e, {smollm2['env']['gpu']})"] = report.smollm2_goals(smollm2)
        sections += report.smollm2_section(smollm2)
    page = REPO_ROOT / "docs" / "RESULTS.md"
    page.write_text(report.package_page(all_results, sections, f"benchmarks/{plot.name}", e2e_goals))
    print(f"wrote {page}")
    readme = REPO_ROOT / "README.md"
    headline = report.headline_table(all_results, "docs/benchmarks", e2e_goals)
    readme.write_text(report.replace_marked(readme.read_text(), "results", headline))
    print(f"updated the headline table in {readme}")
    return 0
