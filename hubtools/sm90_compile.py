"""Compile (never launch) a built kernel's Gluon plans for an H100 / H200 (sm_90a) on a machine without a GPU.

The interpreter cannot run Gluon, so without this a device run is the first to compile those kernels. The
packages' compile tests (`w4a16/tests/test_w4a16_sm90_compile.py`, `tests/test_moe_dispatch_sm90_compile.py`)
call `run_cases` with a case script of their own (`w4a16/tests/sm90_compile.py`,
`tests/moe_dispatch_sm90_compile.py`): it runs in a process without the interpreter (the target must be set
before any kernel compiles), under a Python whose Triton is the release the kernels were built for
(`compiler_python`). The script calls `start`, imports the build (`import_build`) and runs each case's launcher
under `report`: Triton's active driver reports an sm_90a target and `JITFunction.run` compiles with
``warmup=True`` (no launch), so the launchers run as on the GPU up to the kernel call (descriptors, plans, PTX
edits). One JSON line a case: the kernels compiled (name, shared memory, registers, stack bytes a thread) or the
error."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

# the Python (a venv with torch and the kernels' Triton release) to compile with where this one's Triton differs
COMPILE_PYTHON_ENV = "GLUON_COMPILE_PYTHON"
ROOT = Path(__file__).resolve().parent.parent


class _CompileOnlyDriver:
    """What `JITFunction.run` asks of the active driver before it compiles, for an H100 / H200 (sm_90a)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def _resources(cubin: bytes, loops: bool = False) -> dict:
    """Registers and stack bytes a thread (spills) of a cubin, and its waits for all of a warpgroup's wgmma
    (``WARPGROUP.DEPBAR.LE gsb0, 0x0``: where ptxas serialized the wgmma pipeline there is one after every wgmma),
    by Triton's own `cuobjdump`: a compiled kernel's `n_regs` / `n_spills` are read only when it is loaded onto a
    device. With `loops`, also each loop's opcode counts (`loop_opcodes`)."""
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    resources = {"registers": int(found[1]), "stack": int(found[2]), "wgmma": sass.count("HGMMA."),
                 "wgmma_full_waits": sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0")}
    if loops:
        resources["loops"] = [dict(counts) for counts in loop_opcodes(sass)]
    return resources


def loop_opcodes(sass: str) -> list[collections.Counter]:
    """The opcode counts (with their modifiers, predicates dropped) of each loop in a kernel's SASS: a conditional
    backward branch over more than a wait. The mbarrier tests' spins (a TRYWAIT and its branch) and their
    out-of-line retries (unconditional branches back) are not loops."""
    code = [(int(address, 16), text.strip()) for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    found = []
    for address, text in code:
        branch = re.match(r"@!?U?P\w+\s+BRA\s+(0x[0-9a-f]+)", text)
        if branch and int(branch[1], 16) < address:
            body = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in code if int(branch[1], 16) <= a <= address]
            if len(body) > 2:
                found.append(collections.Counter(body))
    return found


def start(loops: bool = False) -> list:
    """Make this process compile for sm_90a without launching; returns the list each compiled kernel's entry is
    appended to (with `loops`, each entry also holds its loops' opcode counts)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_CompileOnlyDriver())
    compiled: list = []
    run = JITFunction.run

    def warmup(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append({"kernel": self.__name__, "shared": kernel.metadata.shared,
                         **_resources(kernel.asm["cubin"], loops)})
        return kernel

    JITFunction.run = warmup
    return compiled


def import_build(build: Path, name: str):
    """The built package's CUDA variant imported as `name` (without `kernels`, so that any Python with torch and
    the right Triton can run this)."""
    variant = Path(build) / "build" / "torch-cuda"
    spec = importlib.util.spec_from_file_location(name, variant / "__init__.py",
                                                  submodule_search_locations=[str(variant)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def report(compiled: list, launch) -> None:
    """Run one case (`launch()`) and print its JSON line: the kernels it compiled, or the error."""
    compiled.clear()
    try:
        launch()
        print(json.dumps({"compiled": compiled}), flush=True)
    except Exception:  # reported to the test, which fails on it
        print(json.dumps({"error": traceback.format_exc()[-3000:]}), flush=True)


def compiler_python(is_release) -> str | None:
    """A Python whose Triton `is_release` accepts: this one, or the one `COMPILE_PYTHON_ENV` names (a venv with
    ``torch`` and the kernels' Triton release, for machines whose own Triton is newer, as CI's interpreter extra
    is)."""
    candidates = [sys.executable] + ([os.environ[COMPILE_PYTHON_ENV]] if COMPILE_PYTHON_ENV in os.environ else [])
    for python in candidates:
        version = subprocess.run([python, "-c", "import triton; print(triton.__version__)"], capture_output=True,
                                 text=True).stdout.strip()
        if version and is_release(version):
            return python
    return None


def run_cases(python: str, script: Path, build: Path, cases: list) -> list[dict]:
    """Each case's JSON line from `script BUILD CASES` run by `python`, without the interpreter, with this
    workspace importable (the script imports this module)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    # a cache of its own: Triton 3.6's kernel cache key leaves out the stage hook PTX edits are made with, so a
    # kernel compiled elsewhere without the edit would be read back here unedited
    env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="sm90-compile-")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    done = subprocess.run([python, str(script), str(build), json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(cases), done.stderr[-3000:]
    return lines
