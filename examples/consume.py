"""Load one kernel from the Hub the way any user does, run a sample call, and say what was loaded.

    python examples/consume.py triton-llm/rmsnorm "k.rms_norm(torch.randn(4, 64), torch.rand(64))"

HF_ENDPOINT selects the hub (huggingface.co when unset). On a GPU, sample tensors are made on it.
"""

import sys
from pathlib import Path

import torch
from kernels import get_kernel


def main(repo_id: str, sample: str) -> None:
    k = get_kernel(repo_id, version=1)
    variant_dir = Path(k.__file__).parent
    # The loader imports from <cache>/snapshots/<commit>/build/<variant>/.
    commit = variant_dir.parent.parent.name
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        out = eval(sample, {"k": k, "torch": torch})
    tensors = out if isinstance(out, tuple) else (out,)
    summary = ", ".join(f"{tuple(t.shape)} {t.dtype} mean {t.float().mean():+.4f}" for t in tensors)
    print(f"{repo_id}: variant {variant_dir.name}, device {device}, commit {commit}")
    print(f"  {sample}\n  -> {summary}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
