"""The hub's storage: every repo is a bare git repository under `<data>/<type>s/<org>/<name>.git`.

Commits, branches and tags are git objects written with plumbing commands, so the data survives restarts and
`git --git-dir <repo> log` works on it. File ids (`oid`, `ETag`) are git blob ids, which is what the client
compares against for no-op uploads. Refs only ever move through `git update-ref <ref> <new> <old>`, a
compare-and-swap, so two hub processes sharing one data folder cannot lose a write. Every name and path a
client sends is checked here before it touches the file system, and repo folders must resolve inside the
data folder.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, Iterator, NamedTuple

from .errors import HubError, bad_request, repo_not_found, revision_not_found

# Namespaces that would make `/{org}/{name}/resolve/...` (model repos) ambiguous with other routes.
RESERVED_NAMESPACES = {"api", "kernels", "models", "datasets", "spaces", "organizations"}

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
PULL_REQUEST_REF_RE = re.compile(r"refs/pr/([1-9][0-9]*)")
MAX_NAME_LENGTH = 96
MAX_PATH_LENGTH = 1024
MAX_REF_NAME_LENGTH = 200
REF_UPDATE_ATTEMPTS = 8

HUB_IDENTITY = {"name": "Kernel Hub", "email": "hub@localhost"}
INITIAL_GITATTRIBUTES = b"# Files are stored as plain git blobs on this hub (no LFS, no Xet).\n* -text\n"
# Git must not pick up the caller's repository, index or config: the hub's repos are self-contained.
GIT_ENV = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")} | {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_AUTHOR_NAME": HUB_IDENTITY["name"],
    "GIT_AUTHOR_EMAIL": HUB_IDENTITY["email"],
    "GIT_COMMITTER_NAME": HUB_IDENTITY["name"],
    "GIT_COMMITTER_EMAIL": HUB_IDENTITY["email"],
    "LC_ALL": "C",
}


# --------------------------------------------------------------------------------------------------- names and paths


def check_repo_part(value: Any, what: str) -> str:
    if not (
        isinstance(value, str)
        and NAME_RE.fullmatch(value)
        and ".." not in value
        and not value.endswith(".git")
        and len(value) <= MAX_NAME_LENGTH
    ):
        raise bad_request(
            f"Invalid {what} {value!r}: use letters, digits, '.', '_' and '-', starting with a letter or digit, "
            f"no '..', no '.git' suffix, at most {MAX_NAME_LENGTH} characters"
        )
    if what == "namespace" and value.lower() in RESERVED_NAMESPACES:
        raise bad_request(f"Invalid namespace {value!r}: it is reserved")
    return value


def check_file_path(path: Any) -> str:
    """A repo-relative POSIX file path: no empty, '.', '..' or '.git' parts, no backslashes or control chars."""
    if not (
        isinstance(path, str)
        and 0 < len(path) <= MAX_PATH_LENGTH
        and "\\" not in path
        and not any(ord(char) < 32 or char == "\x7f" for char in path)
        and not any(part in ("", ".", "..") or part.lower() == ".git" for part in path.split("/"))
    ):
        raise bad_request(
            f"Invalid file path {path!r}: give a relative path without '.', '..' or '.git' parts, "
            f"backslashes, control characters or a leading or doubled '/'"
        )
    return path


def check_new_ref_name(name: Any, kind: str) -> str:
    """A new branch or tag name: a valid git ref name that cannot be mistaken for a commit id, a full ref or
    a command-line option (git itself refuses branch and tag names that start with '-')."""
    namespace = "refs/heads/" if kind == "branch" else "refs/tags/"
    valid = (
        isinstance(name, str)
        and 0 < len(name) <= MAX_REF_NAME_LENGTH
        and not COMMIT_RE.fullmatch(name)
        and not name.startswith("refs/")
        and name != "HEAD"
        and not name.startswith("-")
        and subprocess.run(["git", "check-ref-format", namespace + name], env=GIT_ENV).returncode == 0
    )
    if not valid:
        raise bad_request(f"Invalid {kind} name {name!r}: it must be a valid git ref name (see git check-ref-format)")
    return name


def branch_ref(revision: str) -> str:
    """The ref a commit to `revision` advances: a branch, or an open pull request given as refs/pr/<n>."""
    return revision if PULL_REQUEST_REF_RE.fullmatch(revision) else f"refs/heads/{revision}"


def iso_time(timestamp: int) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


# --------------------------------------------------------------------------------------------------- git repos


class Entry(NamedTuple):
    kind: str  # "file" or "directory"
    mode: str
    oid: str
    size: int


class GitError(RuntimeError):
    """A git command on a repository under the data folder failed."""


def run_git(git_dir: Path, *args: str, input: bytes | None = None, env: dict | None = None, check: bool = True):
    proc = subprocess.run(
        ["git", f"--git-dir={git_dir}", *args], input=input, capture_output=True, env=GIT_ENV | (env or {})
    )
    if check and proc.returncode != 0:
        raise GitError(f"git {' '.join(args)} failed in {git_dir}: {proc.stderr.decode(errors='replace').strip()}")
    return proc


@functools.lru_cache(maxsize=128)
def read_snapshot(git_dir: Path, commit: str) -> dict[str, Entry]:
    """Every file and folder of a commit, by full path. Commits are immutable, so this caches safely."""
    out = run_git(git_dir, "ls-tree", "-r", "-t", "-l", "-z", "--full-tree", commit).stdout
    snapshot = {}
    for record in out.split(b"\0"):
        if not record:
            continue
        meta, path = record.split(b"\t", 1)
        mode, object_type, oid, size = meta.decode().split()
        if object_type in ("blob", "tree"):  # submodule entries have no content to serve
            kind = "file" if object_type == "blob" else "directory"
            snapshot[path.decode(errors="replace")] = Entry(kind, mode, oid, 0 if size == "-" else int(size))
    return snapshot


class GitRepo:
    """One Hub repo stored as a bare git repository."""

    def __init__(self, git_dir: Path):
        self.git_dir = git_dir

    def git(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return run_git(self.git_dir, *args, **kwargs)

    @classmethod
    def create(cls, git_dir: Path) -> bool:
        """Create the repo with an initial commit on `main`; False if it exists (possibly created concurrently)."""
        git_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=git_dir.parent, prefix=".creating-"))
        try:
            subprocess.run(
                ["git", "init", "--quiet", "--bare", "--template=", "--initial-branch=main", str(staging)],
                env=GIT_ENV, check=True, capture_output=True,
            )
            repo = cls(staging)
            [blob] = repo.write_blobs([INITIAL_GITATTRIBUTES])
            tree = repo.write_tree({".gitattributes": ("100644", blob)})
            repo.compare_and_swap("refs/heads/main", repo.commit_tree(tree, None, "initial commit"), "")
            try:
                os.rename(staging, git_dir)  # atomic: fails when another request or process created it first
            except OSError:
                return False
            return True
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    # -- refs

    def refs(self) -> dict[str, str]:
        """Branches, tags and pull request refs, full ref name -> commit (annotated tags peeled)."""
        out = self.git(
            "for-each-ref", "--format=%(refname)%00%(objectname)%00%(*objectname)", "refs/heads", "refs/tags", "refs/pr"
        ).stdout.decode()
        refs = {}
        for line in out.splitlines():
            name, target, peeled = line.split("\0")
            refs[name] = peeled or target
        return refs

    def ref_value(self, ref: str) -> str:
        """The raw object a ref points at (a tag object for annotated tags), or "" when it does not exist."""
        return self.git("rev-parse", "--verify", "--quiet", ref, check=False).stdout.decode().strip()

    def resolve(self, revision: str) -> str:
        """A branch, tag, full ref name or 40-hex commit id -> commit id; RevisionNotFound otherwise."""
        if COMMIT_RE.fullmatch(revision):
            if self.git("cat-file", "-t", revision, check=False).stdout.strip() == b"commit":
                return revision
            raise revision_not_found(revision)
        refs = self.refs()
        candidates = [revision] if revision.startswith("refs/") else [f"refs/heads/{revision}", f"refs/tags/{revision}"]
        for name in candidates:
            if name in refs:
                return refs[name]
        raise revision_not_found(revision)

    def branch_head(self, ref: str) -> str:
        head = self.refs().get(ref)
        if head is None:
            raise HubError(404, "RevisionNotFound", f"{ref} not found: create the branch before committing to it")
        return head

    def compare_and_swap(self, ref: str, new: str | None, old: str) -> bool:
        """Point `ref` at `new` (None deletes it) only if it is at `old` ("" = absent); False if it is elsewhere."""
        args = ("update-ref", "-d", ref, old) if new is None else ("update-ref", ref, new, old)
        for attempt in range(REF_UPDATE_ATTEMPTS):
            if self.git(*args, check=False).returncode == 0:
                return True
            if self.ref_value(ref) != old:
                return False
            time.sleep(0.01 * 2**attempt)  # the ref is still at `old`: another writer holds its lock
        raise HubError(503, "RefLocked", f"{ref} stayed locked by another writer; try again")

    def delete_ref(self, ref: str, short_name: str) -> None:
        current = self.ref_value(ref)
        if not current:
            raise revision_not_found(short_name)
        if not self.compare_and_swap(ref, None, current):
            raise HubError(409, "RefMoved", f"{ref} moved while it was being deleted; try again")

    # -- objects

    def snapshot(self, commit: str) -> dict[str, Entry]:
        return read_snapshot(self.git_dir, commit)

    def write_blobs(self, contents: list[bytes]) -> list[str]:
        if not contents:
            return []
        with tempfile.TemporaryDirectory(prefix="hub-blobs-") as tmp:
            paths = []
            for index, data in enumerate(contents):
                paths.append(os.path.join(tmp, str(index)))
                Path(paths[-1]).write_bytes(data)
            out = self.git("hash-object", "-w", "--no-filters", "--stdin-paths", input="\n".join(paths).encode())
        return out.stdout.decode().split()

    def write_tree(self, files: dict[str, tuple[str, str]]) -> str:
        """Write the tree of `files` (path -> (mode, blob id)) through a temporary index."""
        with tempfile.TemporaryDirectory(prefix="hub-index-") as tmp:
            env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
            listing = b"".join(f"{mode} {oid}\t{path}".encode() + b"\0" for path, (mode, oid) in files.items())
            self.git("update-index", "-z", "--index-info", input=listing, env=env)
            return self.git("write-tree", env=env).stdout.decode().strip()

    def commit_tree(self, tree: str, parent: str | None, message: str) -> str:
        parents = ("-p", parent) if parent else ()
        return self.git("commit-tree", tree, *parents, input=message.encode()).stdout.decode().strip()

    def make_tag(self, commit: str, name: str, message: str) -> str:
        """An annotated tag object (not yet referenced)."""
        tag = (
            f"object {commit}\ntype commit\ntag {name}\n"
            f"tagger {HUB_IDENTITY['name']} <{HUB_IDENTITY['email']}> {int(time.time())} +0000\n\n"
            f"{message.rstrip()}\n"
        )
        return self.git("mktag", input=tag.encode()).stdout.decode().strip()

    def commit_time(self, commit: str) -> int:
        return int(self.git("show", "-s", "--format=%ct", commit).stdout)

    def log(self, commit: str) -> list[dict]:
        out = self.git("log", "--format=%H%x1f%an%x1f%ct%x1f%s%x1f%b%x1e", commit).stdout.decode(errors="replace")
        commits = []
        for record in out.split("\x1e"):
            if record.strip():
                oid, author, timestamp, title, body = record.strip("\n").split("\x1f")
                commits.append({"id": oid, "authors": [{"user": author}], "date": iso_time(int(timestamp)),
                                "title": title, "message": body.strip()})
        return commits

    def copy_blob(self, oid: str, out: BinaryIO) -> None:
        with subprocess.Popen(
            ["git", f"--git-dir={self.git_dir}", "cat-file", "blob", oid], stdout=subprocess.PIPE, env=GIT_ENV
        ) as proc:
            shutil.copyfileobj(proc.stdout, out, 2**20)


# --------------------------------------------------------------------------------------------------- the store


class RepoStore:
    """The repos under one data folder, by type, namespace and name; one in-process lock per repo."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir).resolve()
        self._locks: dict[Path, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def repo_dir(self, repo_type: str, org: str, name: str) -> Path:
        check_repo_part(org, "namespace")
        check_repo_part(name, "repo name")
        git_dir = (self.data_dir / f"{repo_type}s" / org / f"{name}.git").resolve()
        if not git_dir.is_relative_to(self.data_dir):
            raise bad_request(f"Repository {org}/{name} resolves outside the hub's data folder")
        return git_dir

    def open(self, repo_type: str, org: str, name: str) -> GitRepo:
        git_dir = self.repo_dir(repo_type, org, name)
        if not (git_dir / "HEAD").is_file():
            raise repo_not_found(f"{org}/{name}")
        return GitRepo(git_dir)

    def create(self, repo_type: str, org: str, name: str) -> bool:
        """Create the repo; False if it already exists."""
        git_dir = self.repo_dir(repo_type, org, name)
        with self.locked(git_dir):
            return not (git_dir / "HEAD").is_file() and GitRepo.create(git_dir)

    @contextlib.contextmanager
    def locked(self, git_dir: Path) -> Iterator[None]:
        """Serialize the writes of this process to one repo (other processes are held off by the ref CAS)."""
        with self._locks_guard:
            lock = self._locks.setdefault(git_dir, threading.Lock())
        with lock:
            yield
