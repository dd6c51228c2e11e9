"""Publish built kernels to a Hub (huggingface.co or the self-hosted hub) with the real `HfApi`.

What `kernel-builder upload` does, without Nix: create the `kernel` repo, create branch `v<version>`
from main when missing, upload every variant plus `benchmarks/benchmark*.py` to that branch in ONE
commit (deleting stale files under the uploaded variants; on a new branch also every inherited
`build/` file), then put CARD.md as README.md on main. An unchanged build makes no commit.
The endpoint and token come from HF_ENDPOINT / HF_TOKEN, as huggingface_hub reads them.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

from . import checks
from .build import SourceState, build_kernel, source_state
from .workspace import KernelProject


def git_blob_sha1(data: bytes) -> str:
    """The id the Hub gives a file: the git blob hash of its content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Plan:
    repo_id: str
    branch: str
    new_repo: bool
    new_branch: bool
    head: str | None = None  # the version branch's commit when planned (None: no such branch yet)
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    readme_changed: bool = False

    @property
    def has_changes(self) -> bool:
        return bool(self.added or self.changed or self.deleted)

    def describe(self) -> str:
        lines = [
            f"repo    {self.repo_id}{' (new)' if self.new_repo else ''}",
            f"branch  {self.branch}{' (new, from main)' if self.new_branch else ''}",
        ]
        for label, paths in (("add", self.added), ("change", self.changed), ("delete", self.deleted)):
            lines += [f"  {label:<7}{p}" for p in paths]
        if not self.has_changes:
            lines.append("  (build unchanged: no commit)")
        lines.append(f"main    README.md {'updated' if self.readme_changed else 'unchanged'}")
        return "\n".join(lines)


def _local_files(built: Path) -> dict[str, Path]:
    """Repo path -> local file, for everything a publish uploads to the version branch."""
    files = {p.relative_to(built).as_posix(): p for p in sorted((built / "build").rglob("*")) if p.is_file()}
    files.update({f"benchmarks/{p.name}": p for p in sorted((built / "benchmarks").glob("benchmark*.py"))})
    return {k: v for k, v in files.items() if "__pycache__" not in k and not k.endswith(".pyc")}


def _remote_files(api: HfApi, repo_id: str, revision: str) -> dict[str, str]:
    """Repo path -> blob id on `revision`."""
    entries = api.list_repo_tree(repo_id, repo_type="kernel", revision=revision, recursive=True)
    return {e.path: e.blob_id for e in entries if getattr(e, "blob_id", None) is not None}


def plan_publish(api: HfApi, project: KernelProject, built: Path, repo_id: str) -> Plan:
    branch = f"v{project.version}"
    try:
        branches = {b.name: b.target_commit for b in api.list_repo_refs(repo_id, repo_type="kernel").branches}
        new_repo = False
    except RepositoryNotFoundError:
        branches, new_repo = {}, True
    plan = Plan(repo_id=repo_id, branch=branch, new_repo=new_repo, new_branch=branch not in branches,
                head=branches.get(branch))
    remote = {} if new_repo else _remote_files(api, repo_id, branch if not plan.new_branch else "main")
    local = _local_files(built)
    uploaded_variants = {"/".join(p.split("/")[:2]) + "/" for p in local if p.startswith("build/")}
    for path, file in local.items():
        if path not in remote:
            plan.added.append(path)
        elif remote[path] != git_blob_sha1(file.read_bytes()):
            plan.changed.append(path)
    for path in sorted(remote):
        stale_variant_file = any(path.startswith(v) for v in uploaded_variants)
        inherited_build = plan.new_branch and path.startswith("build/")
        stale_benchmark = path.startswith("benchmarks/benchmark")
        if path not in local and (stale_variant_file or inherited_build or stale_benchmark):
            plan.deleted.append(path)
    readme = built / "README.md"
    if readme.exists():
        main_files = {} if new_repo else _remote_files(api, repo_id, "main")
        plan.readme_changed = main_files.get("README.md") != git_blob_sha1(readme.read_bytes())
    return plan


@dataclass
class PublishResult:
    name: str
    plan: Plan
    commit: str | None  # head of the version branch after publishing (None in a dry run of a new repo)
    pin_line: str


@dataclass
class Prepared:
    """A kernel built, checked and planned: everything a publish does before its first write."""

    project: KernelProject
    state: SourceState
    built: Path
    plan: Plan


def build_checked(project: KernelProject, out: Path, *, state: SourceState | None = None,
                  import_checks: bool = True) -> tuple[SourceState, Path]:
    """Check the source, build every variant into `out`, check the build. Raises CheckError."""
    state = state or source_state(project)
    checks.check_source(project)
    built = build_kernel(project, out, state=state)
    if import_checks:
        checks.check_build(project, built)
    return state, built


def prepare_publish(project: KernelProject, build_dir: Path, *, api: HfApi, org: str | None = None,
                    allow_dirty: bool = False, log=print) -> Prepared:
    """Build, check and plan one kernel; writes nothing. Raises CheckError on a failed check or a dirty tree."""
    state = source_state(project)
    if state.dirty and not allow_dirty:
        raise checks.CheckError(
            f"{project.root}: has uncommitted changes; commit them, or pass --allow-dirty for a build "
            f"whose op namespace ends in _dirty (never publish those for others)"
        )
    if state.dirty:
        log(f"WARNING: {project.name} is built from an UNCOMMITTED tree; this build is DIRTY ({state.unique_id})")
    state, built = build_checked(project, build_dir, state=state)
    repo_id = f"{org}/{project.name}" if org else project.repo_id
    return Prepared(project=project, state=state, built=built, plan=plan_publish(api, project, built, repo_id))


def apply_publish(prepared: Prepared, *, api: HfApi, dry_run: bool = False, create_pr: bool = False) -> PublishResult:
    """Carry out a prepared plan: repo, version branch, one commit of the build, README on main."""
    plan, project, state, built = prepared.plan, prepared.project, prepared.state, prepared.built
    repo_id, commit = plan.repo_id, plan.head
    if not dry_run:
        api.create_repo(repo_id, repo_type="kernel", exist_ok=True)
        if plan.new_branch:
            api.create_branch(repo_id, repo_type="kernel", branch=plan.branch, exist_ok=True)
            refs = api.list_repo_refs(repo_id, repo_type="kernel")
            commit = next(b.target_commit for b in refs.branches if b.name == plan.branch)
        if plan.has_changes:
            local = _local_files(built)
            operations = [CommitOperationAdd(p, str(local[p])) for p in plan.added + plan.changed]
            operations += [CommitOperationDelete(p) for p in plan.deleted]
            info = api.create_commit(
                repo_id,
                repo_type="kernel",
                revision=plan.branch,
                operations=operations,
                commit_message=f"{project.name} v{project.version}: build {state.unique_id}",
                commit_description=f"Built from source commit {state.commit} (dirty: {state.dirty}).",
                parent_commit=commit,  # a concurrent publish to this branch makes this one fail, not overwrite
                create_pr=create_pr,
            )
            commit = info.oid
        if plan.readme_changed:
            api.upload_file(
                path_or_fileobj=str(built / "README.md"),
                path_in_repo="README.md",
                repo_id=repo_id,
                repo_type="kernel",
                revision="main",
                commit_message=f"{project.name}: README from CARD.md",
            )
    pin = f'get_kernel("{repo_id}", revision="{commit}")' if commit else "(dry run: nothing published yet)"
    return PublishResult(name=project.name, plan=plan, commit=commit, pin_line=pin)


def publish_kernels(projects: list[KernelProject], build_dir: Path, *, api: HfApi | None = None,
                    org: str | None = None, dry_run: bool = False, create_pr: bool = False,
                    allow_dirty: bool = False, log=print) -> list[PublishResult]:
    """Publish a set of kernels, all or nothing as far as checks go: every kernel is built, checked and
    planned before the first write, and one failure publishes none (CheckError naming every failure)."""
    api = api or HfApi()
    prepared, failures = [], []
    for project in projects:
        try:
            prepared.append(prepare_publish(project, build_dir, api=api, org=org, allow_dirty=allow_dirty, log=log))
        except checks.CheckError as exc:
            failures.append(f"{project.name}: {exc}")
    if failures:
        raise checks.CheckError("nothing was published; fix these first:\n" + "\n".join(failures))
    results = []
    for item in prepared:
        log(item.plan.describe())
        results.append(apply_publish(item, api=api, dry_run=dry_run, create_pr=create_pr))
    return results


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    from .workspace import Workspace

    parser = argparse.ArgumentParser(
        prog="publish.py", description="Build, check and publish kernels to the Hub (HF_ENDPOINT / HF_TOKEN)."
    )
    parser.add_argument("kernels", nargs="*", help="kernel folder names (default: all workspace members)")
    parser.add_argument("--org", help="publish under this Hub org instead of each build.toml's repo-id")
    parser.add_argument("--build-only", action="store_true", help="build and check, publish nothing")
    parser.add_argument("--out", type=Path, help="where builds go (default: a temporary folder)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; write nothing to the Hub")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.add_argument("--allow-dirty", action="store_true", help="publish an uncommitted tree (marked dirty)")
    parser.add_argument("--skip-import-checks", action="store_true", help="with --build-only: no import checks")
    args = parser.parse_args(argv)

    projects = Workspace.load().kernels(args.kernels)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        try:
            if args.build_only:
                for project in projects:
                    _, built = build_checked(project, out, import_checks=not args.skip_import_checks)
                    print(f"{project.name}: built {', '.join(project.backends)} into {built}/build")
                return 0
            for result in publish_kernels(projects, out, org=args.org, dry_run=args.dry_run,
                                          create_pr=args.create_pr, allow_dirty=args.allow_dirty):
                print(f"{result.name}: {'would publish to' if args.dry_run else 'published'} "
                      f"{result.plan.repo_id}@{result.plan.branch} commit {result.commit}")
                print(f"  pin it with: {result.pin_line}")
        except checks.CheckError as exc:
            print(f"NOT published: {exc}", file=sys.stderr)
            return 1
        except HfHubHTTPError as exc:
            # e.g. a refused token, or a branch moved by a concurrent publish (parent_commit no longer its
            # head): the kernel being written got nothing; kernels listed before it were published.
            print(f"publish stopped by the Hub: {exc}", file=sys.stderr)
            return 1
    return 0
