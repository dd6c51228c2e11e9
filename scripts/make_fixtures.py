"""Make checkpoint fixtures with a quantizing tool (run in a venv that has it):

    python scripts/make_fixtures.py w4a16 gptqmodel [--only NAME ...] [--out tests/fixtures/w4a16]
    python scripts/make_fixtures.py moe-dispatch gptqmodel

What each tool makes: tests/fixtures/<kernel>/maker.py (w4a16: gptqmodel, llmcompressor, autoawq; moe-dispatch:
gptqmodel, llmcompressor).
"""

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
KERNELS = {"w4a16": FIXTURES / "w4a16", "moe-dispatch": FIXTURES / "moe_dispatch"}


def _maker(kernel: str):
    sys.path.insert(0, str(FIXTURES))  # the makers import tool_runs
    spec = importlib.util.spec_from_file_location(f"{kernel.replace('-', '_')}_maker", KERNELS[kernel] / "maker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=sorted(KERNELS))
    parser.add_argument("tool")
    parser.add_argument("--only", nargs="*", default=(), help="fixture names to make (default: all of the tool's)")
    parser.add_argument("--out", type=Path, help="default: tests/fixtures/<kernel folder>")
    args = parser.parse_args()
    maker = _maker(args.kernel)
    if args.tool not in maker.MAKERS:
        parser.error(f"tool: {args.kernel} has makers for {', '.join(sorted(maker.MAKERS))}, not {args.tool!r}")
    for folder in maker.make(args.tool, args.out or KERNELS[args.kernel], tuple(args.only)):
        print(folder)


if __name__ == "__main__":
    main()
