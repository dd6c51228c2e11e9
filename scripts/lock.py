"""Lock a downstream project's kernels: `python scripts/lock.py examples/downstream`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hubtools.lock import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
