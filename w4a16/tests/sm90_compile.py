"""Compile (never launch) w4a16 plans for a GPU on a machine without one: `python sm90_compile.py BUILD CASES`,
BUILD a kernel build folder (`hubtools.build.build_kernel`'s), CASES a JSON list of ``[kind, plan, fmt, m]``
(kind: ``"wgmma"`` or ``"mma"``; fmt: ``"int4"``, ``"zp"``, ``"mins"`` or ``"nf4"``). Prints one JSON line a case:
the kernels compiled (name, shared memory, registers, stack bytes a thread) or the error.

Run by `test_w4a16_sm90_compile.py` in a process of its own (the test session runs Triton through the
interpreter, and the target must be set before any kernel compiles), by a Python with Triton 3.6. Triton's active
driver is replaced by one that reports an sm_90a target, and `JITFunction.run` compiles with ``warmup=True`` (no
launch), so the launchers run as they would on the GPU up to the kernel call: descriptors, plans, the PTX edit of
`unlooped_workers`."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class _CompileOnlyDriver:
    """What `JITFunction.run` asks of the active driver before it compiles, for an H100 / H200 (sm_90a)."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def _resources(cubin: bytes) -> dict:
    """Registers and stack bytes a thread (spills) of a cubin, by Triton's own `cuobjdump`: a compiled kernel's
    `n_regs` / `n_spills` are read only when it is loaded onto a device."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                               check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {"registers": int(found[1]), "stack": int(found[2])}


def _compile_only(compiled: list):
    run = JITFunction.run

    def warmup(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append({"kernel": self.__name__, "shared": kernel.metadata.shared, **_resources(kernel.asm["cubin"])})
        return kernel

    return warmup


def _weights(fmt: str, n: int, k: int):
    """Packed words and parameters of the shapes a format has (values do not matter: nothing runs)."""
    group = 64 if fmt == "nf4" else 128
    qweight = torch.zeros(n, k // 8, dtype=torch.int32)
    scales = torch.ones(k // group, n, dtype=torch.float16)
    zeros = torch.zeros(k // group, n, dtype=torch.uint8) if fmt == "zp" else None
    mins = torch.zeros(k // group, n, dtype=torch.float16) if fmt == "mins" else None
    codebook = torch.zeros(16, dtype=torch.float16) if fmt == "nf4" else None
    return qweight, scales, zeros, mins, codebook, group


def _import_build(build: Path):
    """The built package's CUDA variant, imported as ``w4a16`` (without `kernels`, so that any Python with torch
    and the right Triton can run this)."""
    variant = build / "build" / "torch-cuda"
    spec = importlib.util.spec_from_file_location("w4a16", variant / "__init__.py",
                                                  submodule_search_locations=[str(variant)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["w4a16"] = module
    spec.loader.exec_module(module)
    return module


def main(build: str, cases: str) -> None:
    driver.set_active(_CompileOnlyDriver())
    compiled: list = []
    JITFunction.run = _compile_only(compiled)
    launch = _import_build(Path(build)).triton_kernels.launch
    # the H100 / H200 opt-in limit; the launcher otherwise asks the (absent) device
    launch._shared_memory_per_block = lambda index: 232448
    n, k = 3072, 5120
    for kind, plan, fmt, m in json.loads(cases):
        compiled.clear()
        qweight, scales, zeros, mins, codebook, group = _weights(fmt, n, k)
        x = torch.randn(m, k, dtype=torch.float16)
        out = torch.empty(m, n, dtype=torch.float16)
        try:
            getattr(launch, f"_launch_{kind}")(x, qweight, scales, zeros, mins, codebook, None, out, n, k, group,
                                              dict(plan))
            print(json.dumps({"compiled": compiled}), flush=True)
        except Exception:  # reported to the test, which fails on it
            print(json.dumps({"error": traceback.format_exc()[-3000:]}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
