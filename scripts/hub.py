#!/usr/bin/env python3
"""Serve the self-hosted kernel hub: python scripts/hub.py --data DIR [--host 127.0.0.1] [--port 8808]
[--token TOKEN] [--trusted-org ORG ...]. The token may also come from $HUB_TOKEN. See hubtools/hub/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from any directory

from hubtools.hub.server import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
