"""A consumer that pins its kernels with a lock file.

`kernels` 0.17.2 cannot find the lock by itself (`lockfile=None` searches the kernels distribution
instead of the caller's), so the lock is always passed explicitly.

    python app.py            # get_locked_kernel: downloads the locked commit if it is not cached
    python app.py --offline  # load_kernel: only the local cache, never the network

Offline loading needs the whole snapshot of each locked commit in the cache (one variant, as an online
load leaves it, is not enough): warm it first with `python scripts/lock.py examples/downstream --download`.
"""

import argparse
from pathlib import Path

import torch

LOCKFILE = Path(__file__).resolve().parent / "kernels.lock"


def load_rmsnorm(*, offline: bool = False):
    import kernels

    if offline:
        return kernels.load_kernel("triton-llm/rmsnorm", lockfile=LOCKFILE)
    return kernels.get_locked_kernel("triton-llm/rmsnorm", lockfile=LOCKFILE)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--offline", action="store_true")
    args = parser.parse_args()
    rmsnorm = load_rmsnorm(offline=args.offline)
    x = torch.randn(2, 8)
    y = rmsnorm.rms_norm(x, torch.ones(8))
    print(f"{rmsnorm.__name__} from {Path(rmsnorm.__file__).parent}")
    print("rms of each output row:", y.pow(2).mean(-1).sqrt().tolist())


if __name__ == "__main__":
    main()
