"""Write a downstream project's kernels.lock from its `[tool.kernels.dependencies]`.

`kernels lock` hard-codes `trust_remote_code=False` in its trust check, so it cannot lock repos of orgs
the Hub does not list as trusted publishers. This runs the same `kernels.locking` code (which resolves
each `v<N>` branch head, walks every variant and locks kernel dependencies) with that one check
honouring an explicit allowlist. It is the only place this project patches `kernels`.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from unittest import mock


def lock_project(project_dir: Path, *, trust_remote_code: bool | list[str] = False) -> Path:
    import kernels.locking as locking
    from kernels._rust import KernelDependency, KernelVersion
    from kernels.hf_hub import _get_hf_api

    pyproject = project_dir / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text()).get("tool", {}).get("kernels", {}).get("dependencies")
    if not dependencies:
        raise ValueError(f"{pyproject}: no [tool.kernels.dependencies] table to lock")
    depends = [KernelDependency(repo_id=repo, version=KernelVersion.Version(int(v))) for repo, v in dependencies.items()]

    check = locking._check_trust_remote_code

    def check_with_allowlist(*, repo_id, local_files_only, **_hard_coded_false):
        return check(repo_id=repo_id, local_files_only=local_files_only, trust_remote_code=trust_remote_code)

    with mock.patch.object(locking, "_check_trust_remote_code", check_with_allowlist):
        locks = locking.extract_dependency_locks(depends, api=_get_hf_api())
    lockfile = project_dir / "kernels.lock"
    lockfile.write_text(locks.to_json() + "\n")
    return lockfile


def download_locked(project_dir: Path) -> None:
    """Put every locked commit into the kernels cache, whole, so `load_kernel(lockfile=...)` works offline.

    `load_kernel` checks the cached snapshot against the commit's full file list, so the one variant
    that `get_locked_kernel` downloads is not enough.
    """
    from kernels._rust import KernelLocks
    from kernels.hf_hub import CACHE_DIR, _get_hf_api

    api = _get_hf_api()
    for dependency, lock in KernelLocks.from_json((project_dir / "kernels.lock").read_text()).items():
        api.snapshot_download(dependency.repo_id, repo_type="kernel", revision=lock.commit, cache_dir=CACHE_DIR)
        print(f"cached {dependency.repo_id}@{lock.commit}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="lock.py", description="Write PROJECT/kernels.lock (HF_ENDPOINT honoured).")
    parser.add_argument("project", type=Path, help="folder with a pyproject.toml holding [tool.kernels.dependencies]")
    parser.add_argument(
        "--trust-remote-code", nargs="*", metavar="REPO",
        help="allow these repos (no names: all) even if their org is not a trusted publisher",
    )
    parser.add_argument("--download", action="store_true", help="only cache the locked commits for offline use")
    args = parser.parse_args(argv)
    if args.download:
        download_locked(args.project)
        return 0
    trust = False if args.trust_remote_code is None else (args.trust_remote_code or True)
    lockfile = lock_project(args.project, trust_remote_code=trust)
    print(f"wrote {lockfile}")
    print(lockfile.read_text())
    return 0
