"""Run a GPTQ, AWQ or compressed-tensors (llm-compressor) 4-bit checkpoint folder through w4a16.

    python examples/load_checkpoint.py FOLDER [--dtype float16] [--device cpu] [--tokens 1,17,33,5]
    python examples/load_checkpoint.py tests/fixtures/w4a16/gptqmodel/gptq-g32-actorder

FOLDER is a local checkpoint folder (config.json and safetensors, as the quantizing tool saved it or as
downloaded). The w4a16 kernel comes from the hub (`get_kernel("<org>/w4a16", version=1)`) when HF_ENDPOINT
is set, else from a local build of this checkout. Prints which layers became 4-bit and the next-token
prediction for the given token ids.
"""

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def w4a16_kernel(org: str):
    """The w4a16 module from the hub, or from a local build that lasts as long as the block."""
    if os.environ.get("HF_ENDPOINT"):
        import kernels

        repo = f"{org}/w4a16"
        yield kernels.get_kernel(repo, version=1, trust_remote_code=[repo])
        return
    sys.path.insert(0, str(ROOT))
    from hubtools.build import loaded_kernel
    from hubtools.workspace import Workspace

    with loaded_kernel(Workspace.load(ROOT).kernel("w4a16")) as module:
        yield module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="1,17,33,5", help="comma-separated input token ids")
    parser.add_argument("--org", default="triton-llm")
    args = parser.parse_args()

    with w4a16_kernel(args.org) as w4a16:
        # The one call: reads quantization_config, builds the transformers model with its weights on the meta
        # device, swaps each quantized nn.Linear for a W4A16Linear and loads every other tensor.
        model = w4a16.from_pretrained(args.folder, dtype=getattr(torch, args.dtype), device=args.device)

        quantized = [name for name, m in model.named_modules() if isinstance(m, w4a16.W4A16Linear)]
        dense = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        print(f"{args.folder}: {len(quantized)} linear layers in 4 bits, {len(dense)} left dense ({', '.join(dense)})")
        ids = torch.tensor([[int(t) for t in args.tokens.split(",")]], device=args.device)
        with torch.no_grad():
            logits = model(ids).logits
        top = torch.topk(logits[0, -1].float().softmax(-1), 3)
        print("next token:", ", ".join(f"{i} ({p:.3f})" for p, i in zip(top.values.tolist(), top.indices.tolist())))


if __name__ == "__main__":
    main()
