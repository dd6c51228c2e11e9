"""The builder and the checks it runs before anything can be published (hubtools.build, hubtools.checks)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from workspace_copy import git_commit

from hubtools import checks
from hubtools.build import build_kernel, source_state
from hubtools.workspace import Workspace, WorkspaceError

ROOT = Path(__file__).resolve().parent.parent
MEMBERS = Workspace.load(ROOT).members


def _tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", MEMBERS)
def test_build_toml_accepted_by_kernels_parser(workspace, name):
    checks.check_build_toml(workspace.kernel(name))


@pytest.mark.parametrize("name", MEMBERS)
def test_build_is_byte_identical_and_complete(workspace, name, tmp_path):
    project = workspace.kernel(name)
    first = _tree_bytes(build_kernel(project, tmp_path / "a"))
    second = _tree_bytes(build_kernel(project, tmp_path / "b"))
    assert first == second
    for backend in ("cuda", "rocm", "xpu", "cpu"):
        metadata = json.loads(first[f"build/torch-{backend}/metadata.json"])
        assert metadata["backend"] == {"type": backend}
        assert metadata["id"] == f"_{project.python_name}_{backend}_{source_state(project).unique_id}"
        assert metadata["version"] == project.version
        shipped = {p.split("/", 2)[2] for p in first if p.startswith(f"build/torch-{backend}/")}
        assert set(metadata["digest"]["files"]) == shipped - {"metadata.json"}
        assert "_ops.py" in shipped and "__init__.py" in shipped
    assert "README.md" in first


@pytest.mark.parametrize("name", MEMBERS)
def test_every_variant_loads_and_cpu_variant_runs_without_triton(workspace, built_kernel_dir, name):
    """All four variants import through kernels.get_local_kernel in fresh processes; layers pass the
    kernels layer rules; the torch-cpu variant runs its sample call with triton hidden."""
    checks.check_source(workspace.kernel(name))
    checks.check_build(workspace.kernel(name), built_kernel_dir(name))


def test_build_only_cli_writes_four_variants(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "publish.py"), "--build-only", "--skip-import-checks",
         "--out", str(out), "rmsnorm"],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (out / "rmsnorm" / "build").iterdir()) == [
        "torch-cpu", "torch-cuda", "torch-rocm", "torch-xpu"
    ]


def test_namespace_follows_source_tree(scratch_workspace):
    """Different sources never share an op namespace; the same source always gets the same one;
    an uncommitted tree is marked dirty."""
    project = Workspace.load(scratch_workspace).kernel("rmsnorm")
    clean = source_state(project)
    assert not clean.dirty and "_dirty" not in clean.unique_id
    init = project.package_dir / "__init__.py"
    original = init.read_text()
    init.write_text(original + "\n# an edit\n")
    edited = source_state(project)
    assert edited.dirty and edited.unique_id.endswith("_dirty") and edited.tree != clean.tree
    git_commit(scratch_workspace, "edit")
    committed = source_state(project)
    assert not committed.dirty and committed.tree == edited.tree
    init.write_text(original)
    git_commit(scratch_workspace, "revert")
    assert source_state(project).unique_id == clean.unique_id
    # Commits elsewhere in the repository leave the kernel's build untouched.
    (scratch_workspace / "README.md").write_text("changed\n")
    git_commit(scratch_workspace, "unrelated")
    assert source_state(project) == source_state(Workspace.load(scratch_workspace).kernel("rmsnorm"))
    assert source_state(project).unique_id == clean.unique_id


@pytest.mark.parametrize(
    "source",
    [
        'import torch\n@torch.library.custom_op("rmsnorm::f", mutates_args=())\ndef f(x: torch.Tensor) -> torch.Tensor: ...',
        'from torch.library import custom_op\n@custom_op(f"_x_{ns}::f", mutates_args=())\ndef f(x): ...',
        'import torch\n@torch.library.register_fake(prefix("f"))\ndef f(x): ...',
        'import torch\ntorch.library.register_fake("ns::f")(lambda x: x)',
    ],
)
def test_namespace_check_rejects_hard_coded_or_wrapped_names(source):
    problems = checks.namespace_violations(source, "ops.py")
    assert problems and "add_op_namespace_prefix" in problems[0] and "ops.py:" in problems[0]


def test_namespace_check_accepts_the_helper_and_op_objects():
    source = (
        "import torch\nfrom ._ops import add_op_namespace_prefix\n"
        '@torch.library.custom_op(add_op_namespace_prefix("f"), mutates_args=())\ndef f(x): ...\n'
        "@f.register_fake\ndef _(x): ...\n"
        "torch.library.register_autograd(f, lambda ctx, g: g)\n"
    )
    assert checks.namespace_violations(source, "ops.py") == []


def _edit(project, relative: str, transform) -> None:
    path = project.package_dir / relative
    path.write_text(transform(path.read_text()))


def test_check_fails_on_a_hard_coded_namespace_in_a_kernel(scratch_workspace):
    project = Workspace.load(scratch_workspace).kernel("rmsnorm")
    (project.package_dir / "extra_ops.py").write_text(
        'import torch\n@torch.library.custom_op("rmsnorm::bad", mutates_args=())\n'
        "def bad(x: torch.Tensor) -> torch.Tensor:\n    return x\n"
    )
    with pytest.raises(checks.CheckError, match=r"extra_ops\.py:2: .*add_op_namespace_prefix"):
        checks.check_op_namespaces(project)


def test_check_fails_on_a_layer_with_an_init(scratch_workspace, tmp_path):
    project = Workspace.load(scratch_workspace).kernel("rmsnorm")
    _edit(project, "layers.py", lambda s: s + "\n\ndef _init(self):\n    super(RMSNorm, self).__init__()\n\n"
          "RMSNorm.__init__ = _init\n")
    built = build_kernel(project, tmp_path)
    with pytest.raises(checks.CheckError, match="must not override nn.Module constructor"):
        checks.check_variant_imports(project, built, "cpu")


def test_check_fails_on_a_layer_without_declared_flags(scratch_workspace, tmp_path):
    project = Workspace.load(scratch_workspace).kernel("rmsnorm")
    _edit(project, "layers.py", lambda s: s + "\n\ndel RMSNorm.has_backward\n")
    built = build_kernel(project, tmp_path)
    with pytest.raises(checks.CheckError, match="must declare has_backward explicitly"):
        checks.check_variant_imports(project, built, "cpu")


def test_check_fails_when_cpu_variant_needs_triton(scratch_workspace, tmp_path):
    project = Workspace.load(scratch_workspace).kernel("rmsnorm")
    _edit(project, "__init__.py", lambda s: s + "\nimport triton  # unguarded\n")
    built = build_kernel(project, tmp_path)
    checks.check_variant_imports(project, built, "cpu")  # fine while triton is installed
    with pytest.raises(checks.CheckError, match="importing the variant with triton hidden .*import of triton halted"):
        checks.check_variant_imports(project, built, "cpu", hide_triton=True)


def test_check_names_a_layer_target_that_does_not_import(scratch_workspace, tmp_path):
    """The failure says which class could not be imported for the layer check, not that triton is missing."""
    manifest = scratch_workspace / "build.toml"
    manifest.write_text(manifest.read_text().replace("transformers.models.llama.modeling_llama:LlamaRMSNorm",
                                                     "no_such_package.modeling:LlamaRMSNorm"))
    project = Workspace.load(scratch_workspace).kernel("rmsnorm")
    built = build_kernel(project, tmp_path)
    with pytest.raises(checks.CheckError, match=r"importing no_such_package.modeling:LlamaRMSNorm, the class "
                                                r"layers.RMSNorm replaces .*No module named 'no_such_package'"):
        checks.check_variant_imports(project, built, "cpu", hide_triton=True)


def test_check_fails_on_python_depends_outside_the_allowed_list(scratch_workspace):
    manifest = scratch_workspace / "rmsnorm" / "build.toml"
    manifest.write_text(manifest.read_text().replace("[general]\n", '[general]\npython-depends = ["triton"]\n', 1))
    project = Workspace.load(scratch_workspace).kernel("rmsnorm")
    with pytest.raises(checks.CheckError, match="python-depends entry 'triton'"):
        checks.check_python_depends(project)


def test_check_fails_without_flake_or_card_library_name(scratch_workspace):
    project = Workspace.load(scratch_workspace).kernel("rmsnorm")
    checks.check_kernel_builder_files(project)
    card = scratch_workspace / "rmsnorm" / "CARD.md"
    card.write_text(card.read_text().replace("library_name: kernels\n", "", 1))
    with pytest.raises(checks.CheckError, match="library_name: kernels"):
        checks.check_kernel_builder_files(project)
    (scratch_workspace / "rmsnorm" / "flake.nix").unlink()
    with pytest.raises(checks.CheckError, match="genKernelFlakeOutputs"):
        checks.check_kernel_builder_files(project)


def test_check_fails_on_kebab_case_noarch_keys(scratch_workspace):
    manifest = scratch_workspace / "rmsnorm" / "build.toml"
    manifest.write_text(manifest.read_text() + 'cuda-capabilities = ["9.0"]\n')
    with pytest.raises(checks.CheckError, match="rejected by the kernels parser"):
        checks.check_build_toml(Workspace.load(scratch_workspace).kernel("rmsnorm"))


def test_workspace_rejects_a_kernel_whose_name_differs_from_its_folder(scratch_workspace):
    manifest = scratch_workspace / "rmsnorm" / "build.toml"
    manifest.write_text(manifest.read_text().replace('name = "rmsnorm"', 'name = "other"'))
    with pytest.raises(WorkspaceError, match="name must be 'rmsnorm'"):
        Workspace.load(scratch_workspace).kernel("rmsnorm")
