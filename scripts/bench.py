"""Benchmark kernels on the GPU: `python scripts/bench.py rmsnorm w4a16 moe-dispatch`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hubtools.bench.cli import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main())
