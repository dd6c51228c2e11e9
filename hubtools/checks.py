"""Checks a build must pass before it can be published; each failure names the file and the fix.

- build.toml parses with the parser inside the `kernels` wheel (what kernel-builder and the loader read);
- every torch.library registration takes `add_op_namespace_prefix(...)` directly (kernel-builder's
  namespace check: hard-coded or wrapped names collide silently across builds);
- python-depends only names packages `kernels` allows;
- the folder has what kernel-builder's Nix build and the Hub expect of it: a flake.nix calling
  `genKernelFlakeOutputs` and, when there is a CARD.md, `library_name: kernels` in its front matter;
- each variant imports through `kernels.get_local_kernel` in a fresh process and its layers follow the
  `kernels` layer rules; the `torch-cpu` variant does so with triton absent and runs a sample call.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from .workspace import KernelProject

REGISTRATION_FUNCTIONS = {
    "custom_op",
    "triton_op",
    "register_kernel",
    "register_fake",
    "register_vmap",
    "register_torch_dispatch",
    "register_autograd",
}
PREFIX_HELPER = "add_op_namespace_prefix"


class CheckError(Exception):
    """A build that must not be published."""


def check_build_toml(project: KernelProject) -> None:
    from kernels._rust import Build

    try:
        Build.open(project.root)
    except Exception as exc:  # the Rust parser raises plain exceptions with the reason
        raise CheckError(f"{project.root / 'build.toml'}: rejected by the kernels parser: {exc}") from exc


def _registration_name(func: ast.expr) -> str | None:
    """'custom_op' for `torch.library.custom_op`, `library.custom_op` or a bare imported `custom_op`."""
    if isinstance(func, ast.Attribute) and func.attr in REGISTRATION_FUNCTIONS:
        base = func.value
        if isinstance(base, ast.Attribute) and base.attr == "library":
            return func.attr
        if isinstance(base, ast.Name) and base.id == "library":
            return func.attr
        return None  # a method such as `op.register_fake` takes no name
    if isinstance(func, ast.Name) and func.id in REGISTRATION_FUNCTIONS:
        return func.id
    return None


def _is_prefix_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == PREFIX_HELPER


def namespace_violations(source: str, filename: str) -> list[str]:
    """Registrations whose op name is not `add_op_namespace_prefix(...)` passed directly."""
    problems = []
    tree = ast.parse(source, filename=filename)
    decorators = {
        id(d) for node in ast.walk(tree) if hasattr(node, "decorator_list") for d in node.decorator_list
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not (name := _registration_name(node.func)):
            continue
        first = node.args[0] if node.args else None
        # Decorators must name the op through the helper; plain calls may pass an op object instead.
        bad = (
            first is None
            or (id(node) in decorators and not _is_prefix_call(first))
            or isinstance(first, (ast.Constant, ast.JoinedStr, ast.BinOp))
            or (isinstance(first, ast.Call) and not _is_prefix_call(first))
        )
        if bad:
            problems.append(
                f"{filename}:{node.lineno}: torch.library.{name} must take {PREFIX_HELPER}(\"<op>\") "
                f"(from ._ops) directly as its first argument"
            )
    return problems


def check_op_namespaces(project: KernelProject) -> None:
    problems = []
    for path in sorted(project.package_dir.rglob("*.py")):
        problems += namespace_violations(path.read_text(), str(path))
    if problems:
        raise CheckError("\n".join(problems))


def check_python_depends(project: KernelProject) -> None:
    import kernels

    allowed = json.loads((Path(kernels.__file__).parent / "python_depends.json").read_text())
    for dep in project.python_depends:
        per_backend = [allowed["backends"].get(b, {}) for b in project.backends]
        if dep not in allowed["general"] and not all(dep in b for b in per_backend):
            raise CheckError(
                f"{project.root / 'build.toml'}: python-depends entry {dep!r} is not in the list kernels allows "
                f"({sorted(allowed['general'])} plus per-backend packages); triton comes with torch, do not list it"
            )


def check_kernel_builder_files(project: KernelProject) -> None:
    flake = project.root / "flake.nix"
    if not flake.exists() or "genKernelFlakeOutputs" not in flake.read_text():
        raise CheckError(f"{flake}: missing or not calling kernel-builder.lib.genKernelFlakeOutputs; the official "
                         "Nix builder builds a kernel folder only through it (see any kernel folder's flake.nix)")
    card = project.root / "CARD.md"
    if card.exists():
        text = card.read_text()
        front = text.split("---", 2)[1] if text.startswith("---") else ""
        if "library_name: kernels" not in front.splitlines():
            raise CheckError(f"{card}: the front matter needs `library_name: kernels` (the Hub lists the repo "
                             "under the kernels library with it)")


# Run in a fresh interpreter: import the variant with the real loader, check layers, run the smoke call.
# Each stage that fails exits with one line naming the stage and the cause, then the traceback.
_VARIANT_PROBE = r"""
import importlib, json, sys, traceback
spec = json.loads(sys.argv[1])

def stage(what, fn):
    try:
        return fn()
    except BaseException as exc:
        traceback.print_exc()
        print(f"FAILED {what}: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)

if spec["hide_triton"]:
    sys.modules["triton"] = None  # import fails and find_spec returns None, as on a CPU torch wheel
import torch, kernels
from kernels.layer.layer import _validate_layer  # kernels' own layer rules; private, so used only here
where = "with triton hidden " if spec["hide_triton"] else ""
k = stage(f"importing the variant {where}through kernels.get_local_kernel",
          lambda: kernels.get_local_kernel(__import__("pathlib").Path(spec["variant"]), backend=spec["backend"]))
missing = [n for n in getattr(k, "__all__", ()) if not hasattr(k, n)]
if not hasattr(k, "__all__") or missing:
    sys.exit(f"FAILED checking __all__: missing, or it names undefined symbols {missing}")
for layer_name, target in spec["layers"].items():
    module, _, qual = target.partition(":")
    ref = stage(f"importing {target}, the class layers.{layer_name} replaces ([workspace.layers])",
                lambda: getattr(importlib.import_module(module), qual))
    cls = stage(f"finding layers.{layer_name}", lambda: getattr(k.layers, layer_name))
    stage(f"checking layers.{layer_name} against {qual} with the kernels layer rules",
          lambda: _validate_layer(check_cls=ref, cls=cls, repo=f"layers.{layer_name}"))
    for flag in ("can_torch_compile", "has_backward"):
        if flag not in vars(cls):
            sys.exit(f"FAILED checking layers.{layer_name}: it must declare {flag} explicitly")
if spec["smoke"]:
    out = stage(f"running the sample call {spec['smoke']!r} ([workspace.smoke])",
                lambda: eval(spec["smoke"], {"k": k, "torch": torch}))
    print("smoke:", type(out).__name__)
print("ok", k.__name__)
"""


def check_variant_imports(project: KernelProject, built: Path, backend: str, *, hide_triton: bool = False) -> str:
    """Import one variant through kernels.get_local_kernel in a fresh process; return its output."""
    variant = built / "build" / f"torch-{backend}"
    spec = {
        "variant": str(variant),
        # Only "cpu" or the running torch's backend may be requested; other variants load as a path.
        "backend": "cpu" if backend == "cpu" else None,
        "hide_triton": hide_triton,
        # Layers and the sample call are the same source in every variant: check them where they run
        # without triton, once.
        "layers": project.layers if backend == "cpu" else {},
        "smoke": project.smoke if backend == "cpu" else None,
    }
    result = subprocess.run(
        [sys.executable, "-c", _VARIANT_PROBE, json.dumps(spec)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        cause = next((line for line in reversed(lines) if line.startswith("FAILED ")), "FAILED (no stage named)")
        tail = "\n".join(line for line in lines[-15:] if line != cause)
        raise CheckError(f"{variant}: {cause[len('FAILED '):]}\n{tail}")
    return result.stdout


def check_source(project: KernelProject) -> None:
    """The checks that read only the source folder."""
    check_build_toml(project)
    check_op_namespaces(project)
    check_python_depends(project)
    check_kernel_builder_files(project)


def check_build(project: KernelProject, built: Path) -> None:
    """The checks that load the built variants, one fresh process each, run side by side.

    The torch-cpu variant is imported with triton hidden: that is where it must work.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(project.backends)) as pool:
        futures = [
            pool.submit(check_variant_imports, project, built, backend, hide_triton=backend == "cpu")
            for backend in project.backends
        ]
        for future in futures:
            future.result()
