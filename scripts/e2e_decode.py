"""Batch-1 greedy decode tokens/s of whole models, bf16 vs w4a16 (+ rmsnorm, + fused residual norms):
`python scripts/e2e_decode.py`.

`--tiny --device cpu` runs the same code on a CPU-sized model (no CUDA graphs, no timing claims).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hubtools.e2e.decode import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
