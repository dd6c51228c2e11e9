"""Session fixtures for every test folder (`tests/` and each kernel's `<kernel>/tests/`, where kernel-builder's
layout keeps a kernel's own tests): kernels are built with the real builder and loaded with
`kernels.get_local_kernel`.

Tests never import the source tree, so packaging is exercised on every run. Without CUDA the session
runs Triton kernels through the interpreter (TRITON_INTERPRET must be set before triton is imported).
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The interpreter needs TRITON_INTERPRET=1 before triton is imported; on a GPU machine it stays unset.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None

from hubtools.build import build_kernel, load_build  # noqa: E402
from hubtools.workspace import Workspace  # noqa: E402


@pytest.fixture(scope="session")
def workspace() -> Workspace:
    return Workspace.load(ROOT)


@pytest.fixture(scope="session")
def built_kernel_dir(workspace, tmp_path_factory):
    """`built_kernel_dir("rmsnorm")` -> folder holding `build/torch-*`; each kernel is built once."""
    out = tmp_path_factory.mktemp("builds")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_kernel(workspace.kernel(name), out)
        return built[name]

    return get


@pytest.fixture(scope="session")
def load_kernel(built_kernel_dir):
    """`load_kernel("rmsnorm")` -> the kernel module, imported from its build by kernels.get_local_kernel."""
    loaded = {}
    # Triton picks interpreted or compiled kernels when the module is imported; a test that sets
    # TRITON_INTERPRET=0 for its own calls must not decide that for the rest of the session.
    interpret = os.environ.get("TRITON_INTERPRET")

    def get(name: str):
        if name not in loaded:
            with pytest.MonkeyPatch.context() as env:
                if interpret is None:
                    env.delenv("TRITON_INTERPRET", raising=False)
                else:
                    env.setenv("TRITON_INTERPRET", interpret)
                loaded[name] = load_build(built_kernel_dir(name))
        return loaded[name]

    return get


def pytest_configure(config):
    """Without a GPU the Triton kernels are tested through the interpreter: a missing triton would skip
    those tests silently, so it stops the run instead."""
    if not torch.cuda.is_available() and importlib.util.find_spec("triton") is None:
        raise pytest.UsageError('no CUDA GPU and no triton: install the interpreter extra '
                                '(pip install -e ".[test,interpreter]") to test the Triton kernels on CPU')


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.fspath.basename.endswith("_gpu.py"):
            item.add_marker(skip)



@pytest.fixture
def scratch_workspace(tmp_path) -> Path:
    """A committed git copy of this workspace in a temporary folder, for tests that edit or publish."""
    from workspace_copy import make_scratch_workspace

    return make_scratch_workspace(tmp_path / "workspace")


@pytest.fixture(params=[
    pytest.param("triton", marks=pytest.mark.skipif(not INTERPRETED, reason="needs triton with TRITON_INTERPRET=1")),
    "torch",
])
def path(request, monkeypatch):
    """Which implementation the ops dispatch to: they read TRITON_INTERPRET at call time (1: the Triton
    kernels through the interpreter, 0: the PyTorch path)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1" if request.param == "triton" else "0")
    return request.param
