"""w4a16's sm_90a compile cases (`hubtools.sm90_compile`): `python sm90_compile.py BUILD CASES`, BUILD a kernel
build folder (`hubtools.build.build_kernel`'s), CASES a JSON list of ``[kind, plan, fmt, m]`` (kind: ``"wgmma"``,
``"mma"`` or ``"gemv_h2"``; fmt: ``"int4"``, ``"zp"``, ``"mins"`` or ``"nf4"``, with ``-gN`` a group size),
each run through its launcher (`_launch_wgmma` / `_launch_mma` / `_launch_gemv_h2`). Run by
`test_w4a16_sm90_compile.py`."""

from __future__ import annotations

import json
import sys

import torch

from hubtools.sm90_compile import import_build, report, start


def _weights(fmt: str, n: int, k: int):
    """Packed words and parameters of the shapes a format has (values do not matter: nothing runs). A suffix
    ``-gN`` sets the group size (else 64 for NF4, 128 for int4)."""
    fmt, _, group = fmt.partition("-g")
    group = int(group) if group else 64 if fmt == "nf4" else 128
    qweight = torch.zeros(n, k // 8, dtype=torch.int32)
    scales = torch.ones(k // group, n, dtype=torch.float16)
    zeros = torch.zeros(k // group, n, dtype=torch.uint8) if fmt == "zp" else None
    mins = torch.zeros(k // group, n, dtype=torch.float16) if fmt == "mins" else None
    codebook = torch.zeros(16, dtype=torch.float16) if fmt == "nf4" else None
    return qweight, scales, zeros, mins, codebook, group


def main(build: str, cases: str) -> None:
    compiled = start()
    launch = import_build(build, "w4a16").triton_kernels.launch
    # the H100 / H200 opt-in limit; the launcher otherwise asks the (absent) device
    launch._shared_memory_per_block = lambda index: 232448
    n, k = 3072, 5120
    for kind, plan, fmt, m in json.loads(cases):
        qweight, scales, zeros, mins, codebook, group = _weights(fmt, n, k)
        x = torch.randn(m, k, dtype=torch.float16)
        out = torch.empty(m, n, dtype=torch.float16)
        report(compiled, lambda: getattr(launch, f"_launch_{kind}")(x, qweight, scales, zeros, mins, codebook, None,
                                                                     out, n, k, group, dict(plan)))


if __name__ == "__main__":
    main(*sys.argv[1:])
