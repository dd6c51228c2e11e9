"""Build, check and publish kernels: `python scripts/publish.py [KERNEL ...] [--build-only --out DIR]`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hubtools.publish import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
