"""Make the moe-dispatch quantized-MoE checkpoint fixtures with a quantizing tool (run in a venv that has it):

    python scripts/make_moe_dispatch_fixtures.py gptqmodel [--only NAME ...] [--out tests/fixtures/moe_dispatch]

Tools: gptqmodel (see tests/fixtures/moe_dispatch/maker.py for what each makes).
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "moe_dispatch"))

import maker  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tool", choices=sorted(maker.MAKERS))
    parser.add_argument("--only", nargs="*", default=(), help="fixture names to make (default: all of the tool's)")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "moe_dispatch")
    args = parser.parse_args()
    for folder in maker.make(args.tool, args.out, tuple(args.only)):
        print(folder)


if __name__ == "__main__":
    main()
