"""Generate docs/benchmarks/<kernel>.md and roofline PNGs from results files: `python scripts/report.py`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hubtools.report import report_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(report_main())
