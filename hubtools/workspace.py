"""The workspace manifest (top-level build.toml) and the kernel projects it lists.

A kernel folder's own build.toml wins wherever both set a value; the workspace only supplies the Hub
org and shared defaults (license, backends, kernels-minver).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
NOARCH_BACKENDS = ("cuda", "rocm", "xpu", "cpu")


class WorkspaceError(ValueError):
    """A manifest or kernel project that cannot be built; the message names the file and the fix."""


@dataclass(frozen=True)
class KernelProject:
    root: Path  # the kernel folder, e.g. <workspace>/rmsnorm
    name: str  # Hub name, e.g. "moe-dispatch"
    version: int
    license: str
    backends: tuple[str, ...]
    repo_id: str
    kernels_minver: str | None
    python_depends: tuple[str, ...]
    pyext: tuple[str, ...]
    smoke: str | None  # a Python expression over `k` (the loaded kernel) and `torch`
    layers: dict[str, str] = field(default_factory=dict)  # layer name -> "module:Class" it replaces

    @property
    def python_name(self) -> str:
        return self.name.replace("-", "_")

    @property
    def package_dir(self) -> Path:
        return self.root / "torch-ext" / self.python_name


@dataclass(frozen=True)
class Workspace:
    root: Path
    org: str
    members: tuple[str, ...]
    defaults: dict
    smoke: dict
    layers: dict

    @classmethod
    def load(cls, root: Path = REPO_ROOT) -> "Workspace":
        manifest = root / "build.toml"
        try:
            data = tomllib.loads(manifest.read_text())["workspace"]
        except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
            raise WorkspaceError(f"{manifest}: needs a [workspace] table with org and members ({exc})") from exc
        return cls(
            root=root,
            org=data["org"],
            members=tuple(data["members"]),
            defaults=data.get("defaults", {}),
            smoke=data.get("smoke", {}),
            layers=data.get("layers", {}),
        )

    def kernel(self, name: str) -> KernelProject:
        if name not in self.members:
            raise WorkspaceError(f"unknown kernel {name!r}; the workspace build.toml lists {list(self.members)}")
        root = self.root / name
        manifest = root / "build.toml"
        try:
            data = tomllib.loads(manifest.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise WorkspaceError(f"{manifest}: cannot read it ({exc})") from exc
        general = data.get("general", {})
        if general.get("name") != name:
            raise WorkspaceError(f"{manifest}: [general] name must be {name!r}, the folder name")
        if general.get("edition") != 5:
            raise WorkspaceError(f"{manifest}: set edition = 5 in [general]")
        if not isinstance(general.get("version"), int):
            raise WorkspaceError(f"{manifest}: set an integer major version in [general] (version = 1)")
        backends = tuple(general.get("backends", self.defaults.get("backends", NOARCH_BACKENDS)))
        unknown = sorted(set(backends) - set(NOARCH_BACKENDS))
        if unknown:
            raise WorkspaceError(f"{manifest}: backends {unknown} are not noarch Triton backends {NOARCH_BACKENDS}")
        hub = general.get("hub", {})
        return KernelProject(
            root=root,
            name=name,
            version=general["version"],
            license=general.get("license", self.defaults.get("license", "Apache-2.0")),
            backends=backends,
            repo_id=hub.get("repo-id", f"{self.org}/{name}"),
            kernels_minver=general.get("kernels-minver", self.defaults.get("kernels-minver")),
            python_depends=tuple(general.get("python-depends", ())),
            pyext=tuple(data.get("torch-noarch", {}).get("pyext", ("py",))),
            smoke=self.smoke.get(name),
            layers={k.split(".", 1)[1]: v for k, v in self.layers.items() if k.split(".", 1)[0] == name},
        )

    def kernels(self, names: list[str] | None = None) -> list[KernelProject]:
        return [self.kernel(n) for n in (names or self.members)]
