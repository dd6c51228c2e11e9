"""A self-hosted kernel hub: the part of the Hugging Face Hub HTTP API that `huggingface_hub.HfApi` and `kernels` use.

It serves the endpoints, headers and error codes that huggingface_hub 2.4.0 and kernels 0.17.2 rely on, for
`kernel` repos and, at no extra cost, `model` repos (tests/test_hub_server.py holds the conformance tests). Every
repo is a bare git repository under `<data>/<type>s/<org>/<name>.git`: commits, branches and tags are git objects
written with plumbing commands, so the data survives restarts and `git --git-dir <repo> log` works on it. File ids
(`oid`, `ETag`) are git blob ids, which is what the client compares against for no-op uploads.

Writes need `Authorization: Bearer <token>` when the hub has a token; reads are open. Commits to one repo are
serialized by a lock in this process and land through `git update-ref <ref> <new> <old>`, a compare-and-swap, so
two hub processes sharing one data folder cannot lose a write either.

Run it with `python scripts/hub.py --data DIR`; tests and tooling use `running_hub(data_dir)`.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import functools
import hmac
import http.client
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, NamedTuple
from urllib.parse import parse_qsl, unquote, urlsplit

REPO_ROOT = Path(__file__).resolve().parent.parent

REPO_TYPES = {"kernels": "kernel", "models": "model"}  # API path segment -> repo type
URL_PREFIXES = {"kernel": "kernels/", "model": ""}  # repo type -> prefix of its web and resolve URLs
# Namespaces that would make `/{org}/{name}/resolve/...` (model repos) ambiguous with other routes.
RESERVED_NAMESPACES = {"api", "kernels", "models", "datasets", "spaces", "organizations"}

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
PULL_REQUEST_REF_RE = re.compile(r"refs/pr/([1-9][0-9]*)")
MAX_NAME_LENGTH = 96
MAX_PATH_LENGTH = 1024
MAX_REF_NAME_LENGTH = 200
DEFAULT_MAX_BODY_BYTES = 512 * 2**20
DEFAULT_MAX_FILES = 10_000  # operations per commit, and files per preupload request
REF_UPDATE_ATTEMPTS = 8
TRUE_VALUES = {"1", "true", "True"}

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


# --------------------------------------------------------------------------------------------------- errors


class HubError(Exception):
    """An error answered the Hub's way: status, `X-Error-Code`, `X-Error-Message` and a JSON `error` body."""

    def __init__(self, status: int, code: str, message: str, *, headers: dict | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}
        self.extra = extra or {}

    def reply(self) -> "Reply":
        # Header values must be single-line latin-1; the JSON body keeps the exact text.
        header_message = " ".join(self.message.encode("ascii", "replace").decode().split())
        headers = {"X-Error-Code": self.code, "X-Error-Message": header_message, **self.headers}
        return Reply({"error": self.message, **self.extra}, status=self.status, headers=headers)


def bad_request(message: str) -> HubError:
    return HubError(400, "BadRequest", message)


def repo_not_found(repo_id: str) -> HubError:
    return HubError(404, "RepoNotFound", f"Repository {repo_id} not found")


def revision_not_found(revision: str) -> HubError:
    return HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")


def entry_not_found(message: str, commit: str) -> HubError:
    # The client caches a `.no_exist` marker for the commit named in X-Repo-Commit.
    return HubError(404, "EntryNotFound", message, headers={"X-Repo-Commit": commit})


# --------------------------------------------------------------------------------------------------- validation


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


# --------------------------------------------------------------------------------------------------- git storage


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


def branch_ref(revision: str) -> str:
    """The ref a commit to `revision` advances: a branch, or an open pull request given as refs/pr/<n>."""
    return revision if PULL_REQUEST_REF_RE.fullmatch(revision) else f"refs/heads/{revision}"


def iso_time(timestamp: int) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


# --------------------------------------------------------------------------------------------------- commits


class Operation(NamedTuple):
    kind: str  # "file", "deletedFile" or "deletedFolder"
    path: str
    content: bytes | None = None


class CommitHeader(NamedTuple):
    summary: str
    description: str
    parent: str | None


def parse_commit_payload(body: bytes, max_operations: int) -> tuple[CommitHeader, list[Operation]]:
    """The NDJSON commit body: a header line, then one line per operation."""
    try:
        records = [json.loads(line) for line in body.splitlines() if line.strip()]
    except ValueError as exc:
        raise bad_request(f"The commit body must be NDJSON ({exc})") from None
    if not records or not isinstance(records[0], dict) or records[0].get("key") != "header":
        raise bad_request("The first line of a commit must be {'key': 'header', 'value': {...}}")
    if len(records) - 1 > max_operations:
        raise HubError(413, "TooManyOperations",
                       f"{len(records) - 1} operations in one commit; the limit is {max_operations}")
    header = records[0].get("value") or {}
    if not isinstance(header, dict):
        raise bad_request("The commit header's 'value' must be a JSON object")
    summary, parent = header.get("summary"), header.get("parentCommit")
    if not isinstance(summary, str) or not summary.strip():
        raise bad_request("The commit header needs a non-empty 'summary'")
    if parent is not None and not (isinstance(parent, str) and COMMIT_RE.fullmatch(parent)):
        raise bad_request(f"Invalid parentCommit {parent!r}: give a 40-character commit id")
    description = header.get("description") or ""
    return CommitHeader(summary, description if isinstance(description, str) else "", parent), [
        parse_operation(record) for record in records[1:]
    ]


def parse_operation(record: Any) -> Operation:
    key = record.get("key") if isinstance(record, dict) else None
    value = record.get("value") if isinstance(record, dict) else None
    if not isinstance(value, dict):
        raise bad_request(f"Malformed commit line: {record!r}")
    if key == "file":
        if value.get("encoding") != "base64" or not isinstance(value.get("content"), str):
            raise bad_request(f"File {value.get('path')!r} needs base64 'content' with encoding 'base64'")
        try:
            content = base64.b64decode(value["content"], validate=True)
        except binascii.Error:
            raise bad_request(f"File {value.get('path')!r}: 'content' is not valid base64") from None
        return Operation("file", check_file_path(value.get("path")), content)
    if key == "deletedFile":
        return Operation("deletedFile", check_file_path(value.get("path")))
    if key == "deletedFolder":
        path = value.get("path")
        return Operation("deletedFolder", check_file_path(path.rstrip("/") if isinstance(path, str) else path))
    if key == "lfsFile":
        raise bad_request("LFS files are not supported: this hub answers preupload with 'regular' for every file")
    raise bad_request(f"Unknown commit operation {key!r}")


def apply_operations(
    snapshot: dict[str, Entry], operations: list[Operation], blob_ids: dict[int, str], commit: str
) -> dict[str, tuple[str, str]]:
    """The file set (path -> (mode, blob id)) after applying `operations`, in order, on top of `snapshot`."""
    files = {path: (entry.mode, entry.oid) for path, entry in snapshot.items() if entry.kind == "file"}
    for index, operation in enumerate(operations):
        if operation.kind == "file":
            mode = "100755" if files.get(operation.path, ("",))[0] == "100755" else "100644"
            files[operation.path] = (mode, blob_ids[index])
        elif operation.kind == "deletedFile":
            if files.pop(operation.path, None) is None:
                raise entry_not_found(f"A file with this name doesn't exist: {operation.path}", commit)
        else:
            inside = [path for path in files if path.startswith(operation.path + "/")]
            if not inside:
                raise entry_not_found(f"A folder with this name doesn't exist: {operation.path}", commit)
            for path in inside:
                del files[path]
    for path in files:
        parent = path.rpartition("/")[0]
        while parent:
            if parent in files:
                raise bad_request(f"{path!r} needs {parent!r} to be a folder, but it is a file")
            parent = parent.rpartition("/")[0]
    return files


def write_operation_blobs(repo: GitRepo, operations: list[Operation]) -> dict[int, str]:
    """Store the added files' contents; operation index -> blob id."""
    additions = [index for index, operation in enumerate(operations) if operation.kind == "file"]
    return dict(zip(additions, repo.write_blobs([operations[index].content for index in additions])))


def build_commit(
    repo: GitRepo, parent: str, header: CommitHeader, operations: list[Operation], blob_ids: dict[int, str]
) -> str:
    """A commit object (not yet referenced) applying `operations` on top of `parent`."""
    files = apply_operations(repo.snapshot(parent), operations, blob_ids, parent)
    message = header.summary + (f"\n\n{header.description}" if header.description.strip() else "")
    return repo.commit_tree(repo.write_tree(files), parent, message)


# --------------------------------------------------------------------------------------------------- requests


@dataclass
class Request:
    method: str
    segments: list[str]  # the URL path split on "/" first, then each piece unquoted
    query: dict[str, str]
    headers: Message
    body: bytes
    endpoint: str  # how the client reached us, e.g. "http://127.0.0.1:8808"

    def json(self) -> dict:
        if not self.body.strip():
            return {}
        try:
            value = json.loads(self.body)
        except ValueError:
            raise bad_request("The request body must be JSON") from None
        if not isinstance(value, dict):
            raise bad_request("The request body must be a JSON object")
        return value


@dataclass
class Reply:
    body: Any = None  # JSON-serialisable; ignored when `stream` is set
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    stream: Callable[[BinaryIO], None] | None = None  # writes a body whose Content-Length is in `headers`


class Route(NamedTuple):
    method: str
    pattern: tuple[str, ...]  # literal segments, "{name}" for one segment, "{name*}" for all remaining ones
    action: str
    fixed: dict

    def match(self, segments: list[str]) -> dict | None:
        params = dict(self.fixed)
        for index, part in enumerate(self.pattern):
            if part.endswith("*}"):
                params[part[1:-2]] = "/".join(segments[index:])
                return params
            if index >= len(segments):
                return None
            segment = segments[index]
            if part == "{repo_type}":
                if segment not in REPO_TYPES:
                    return None
                params["repo_type"] = REPO_TYPES[segment]
            elif part.startswith("{"):
                params[part[1:-1]] = segment
            elif part != segment:
                return None
        return params if len(segments) == len(self.pattern) else None


def route(method: str, pattern: str, action: str, **fixed) -> Route:
    return Route(method, tuple(pattern.split("/")), action, fixed)


REPO = "api/{repo_type}/{org}/{name}"
ROUTES = [
    route("POST", "api/repos/create", "create_repo"),
    route("POST", "api/validate-yaml", "validate_yaml"),
    route("GET", "api/organizations/{org}/overview", "organization_overview"),
    route("GET", REPO, "repo_info"),
    route("GET", REPO + "/revision/{rev}", "repo_info"),
    route("GET", REPO + "/refs", "list_refs"),
    route("GET", REPO + "/tree/{rev}/{path*}", "list_tree"),
    route("GET", REPO + "/commits/{rev}", "list_commits"),
    route("POST", REPO + "/preupload/{rev}", "preupload"),
    route("POST", REPO + "/commit/{rev}", "commit"),
    route("POST", REPO + "/branch/{branch}", "create_branch"),
    route("DELETE", REPO + "/branch/{branch}", "delete_branch"),
    route("POST", REPO + "/tag/{rev}", "create_tag"),
    route("DELETE", REPO + "/tag/{tag}", "delete_tag"),
    route("GET", "kernels/{org}/{name}/resolve/{rev}/{path*}", "resolve", repo_type="kernel"),
    route("GET", "{org}/{name}/resolve/{rev}/{path*}", "resolve", repo_type="model"),
]


# --------------------------------------------------------------------------------------------------- the hub


class KernelHub:
    """The Hub API over a data folder; `handle(request)` answers one request (HTTP-independent)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        token: str | None = None,
        trusted_orgs: tuple[str, ...] = (),
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_files: int = DEFAULT_MAX_FILES,
    ):
        self.data_dir = Path(data_dir).resolve()
        self.token = token or None
        self.trusted_orgs = frozenset(trusted_orgs)
        self.max_body_bytes = max_body_bytes
        self.max_files = max_files
        self._locks: dict[Path, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def handle(self, request: Request) -> Reply:
        if request.method not in ("GET", "HEAD"):
            self.authorize(request)
        method = "GET" if request.method == "HEAD" else request.method
        for candidate in ROUTES:
            if candidate.method == method and (params := candidate.match(request.segments)) is not None:
                return getattr(self, candidate.action)(request, **params)
        raise HubError(404, "NotFound", f"No endpoint {request.method} /{'/'.join(request.segments)} on this hub")

    def authorize(self, request: Request) -> None:
        if self.token is None:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise HubError(401, "Unauthorized", "Writes need an 'Authorization: Bearer <token>' header (set HF_TOKEN)")
        if not hmac.compare_digest(token.strip().encode(), self.token.encode()):
            raise HubError(401, "Unauthorized", "Invalid credentials in Authorization header")

    # -- repos on disk

    def repo_dir(self, repo_type: str, org: str, name: str) -> Path:
        check_repo_part(org, "namespace")
        check_repo_part(name, "repo name")
        git_dir = (self.data_dir / f"{repo_type}s" / org / f"{name}.git").resolve()
        if not git_dir.is_relative_to(self.data_dir):
            raise bad_request(f"Repository {org}/{name} resolves outside the hub's data folder")
        return git_dir

    def open_repo(self, repo_type: str, org: str, name: str) -> GitRepo:
        git_dir = self.repo_dir(repo_type, org, name)
        if not (git_dir / "HEAD").is_file():
            raise repo_not_found(f"{org}/{name}")
        return GitRepo(git_dir)

    @contextlib.contextmanager
    def locked(self, git_dir: Path) -> Iterator[None]:
        with self._locks_guard:
            lock = self._locks.setdefault(git_dir, threading.Lock())
        with lock:
            yield

    # -- endpoints

    def create_repo(self, request: Request) -> Reply:
        payload = request.json()
        repo_type = payload.get("type") or "model"
        if not isinstance(repo_type, str) or repo_type not in URL_PREFIXES:
            raise bad_request(f"Repo type {repo_type!r} is not served here; use one of {sorted(URL_PREFIXES)}")
        if payload.get("private") or payload.get("visibility") not in (None, "public"):
            raise bad_request("This hub serves public repos only: every read is open")
        org, name = payload.get("organization"), payload.get("name")
        if not org:
            raise bad_request("Give the repo id with its namespace, '<org>/<name>'")
        git_dir = self.repo_dir(repo_type, org, name)
        url = f"{request.endpoint}/{URL_PREFIXES[repo_type]}{org}/{name}"
        with self.locked(git_dir):
            if (git_dir / "HEAD").is_file() or not GitRepo.create(git_dir):
                # The client reads `url` from the 409 body when exist_ok=True.
                raise HubError(409, "RepoExists", f"You already created this {repo_type} repo: {org}/{name}",
                               extra={"url": url})
        return Reply({"url": url, "name": f"{org}/{name}"})

    def validate_yaml(self, request: Request) -> Reply:
        return Reply({"errors": [], "warnings": []})

    def organization_overview(self, request: Request, org: str) -> Reply:
        check_repo_part(org, "namespace")
        trusted = org in self.trusted_orgs
        return Reply({"name": org, "fullname": org, "avatarUrl": "", "trustedKernelPublisher": trusted})

    def repo_info(self, request: Request, repo_type: str, org: str, name: str, rev: str = "main") -> Reply:
        repo = self.open_repo(repo_type, org, name)
        commit = repo.resolve(rev)
        files = [path for path, entry in repo.snapshot(commit).items() if entry.kind == "file"]
        return Reply({
            "id": f"{org}/{name}", "author": org, "sha": commit, "private": False, "disabled": False,
            "gated": False, "lastModified": iso_time(repo.commit_time(commit)), "tags": [],
            "siblings": [{"rfilename": path} for path in files],
        })

    def list_refs(self, request: Request, repo_type: str, org: str, name: str) -> Reply:
        refs = self.open_repo(repo_type, org, name).refs()

        def refs_under(prefix: str) -> list[dict]:
            return [{"name": ref[len(prefix):], "ref": ref, "targetCommit": commit}
                    for ref, commit in refs.items() if ref.startswith(prefix)]

        pull_requests = [{"name": ref, "ref": ref, "targetCommit": commit}
                         for ref, commit in refs.items() if ref.startswith("refs/pr/")]
        return Reply({"branches": refs_under("refs/heads/"), "tags": refs_under("refs/tags/"),
                      "converts": [], "pullRequests": pull_requests})

    def list_tree(self, request: Request, repo_type: str, org: str, name: str, rev: str, path: str) -> Reply:
        repo = self.open_repo(repo_type, org, name)
        path = check_file_path(path.rstrip("/")) if path.rstrip("/") else ""
        commit = repo.resolve(rev)
        snapshot = repo.snapshot(commit)
        if path and (path not in snapshot or snapshot[path].kind != "directory"):
            raise entry_not_found(f"Folder {path!r} not found at {commit}", commit)
        recursive = request.query.get("recursive") in TRUE_VALUES
        prefix = f"{path}/" if path else ""
        items = []
        for item_path, entry in snapshot.items():
            if item_path.startswith(prefix) and (recursive or "/" not in item_path[len(prefix):]):
                item = {"type": entry.kind, "path": item_path, "oid": entry.oid}
                if entry.kind == "file":
                    item["size"] = entry.size
                items.append(item)
        return Reply(items)

    def list_commits(self, request: Request, repo_type: str, org: str, name: str, rev: str) -> Reply:
        repo = self.open_repo(repo_type, org, name)
        return Reply(repo.log(repo.resolve(rev)))

    def preupload(self, request: Request, repo_type: str, org: str, name: str, rev: str) -> Reply:
        repo = self.open_repo(repo_type, org, name)
        files = request.json().get("files")
        if not isinstance(files, list) or len(files) > self.max_files:
            raise bad_request(f"'files' must be a list of at most {self.max_files} entries")
        snapshot = repo.snapshot(repo.resolve(rev))
        answers = []
        for item in files:
            path = check_file_path(item.get("path") if isinstance(item, dict) else None)
            current = snapshot.get(path)
            # Always "regular": content travels inline in the commit, never through LFS or Xet.
            answers.append({"path": path, "uploadMode": "regular", "shouldIgnore": False,
                            "oid": current.oid if current and current.kind == "file" else None})
        return Reply({"files": answers})

    def commit(self, request: Request, repo_type: str, org: str, name: str, rev: str) -> Reply:
        repo = self.open_repo(repo_type, org, name)
        header, operations = parse_commit_payload(request.body, self.max_files)
        repo_url = f"{request.endpoint}/{URL_PREFIXES[repo_type]}{org}/{name}"
        pull_request_url = None
        with self.locked(repo.git_dir):
            if request.query.get("create_pr") in TRUE_VALUES:
                commit, number = self.open_pull_request(repo, rev, header, operations)
                pull_request_url = f"{repo_url}/discussions/{number}"  # the client derives refs/pr/<n> from it
            else:
                commit = self.land_commit(repo, branch_ref(rev), header, operations)
        return Reply({"commitUrl": f"{repo_url}/commit/{commit}", "commitOid": commit,
                      "pullRequestUrl": pull_request_url})

    def land_commit(self, repo: GitRepo, ref: str, header: CommitHeader, operations: list[Operation]) -> str:
        """Build the commit on the branch head and move the branch with a compare-and-swap; rebuild if it moved."""
        blob_ids = write_operation_blobs(repo, operations)
        for _ in range(REF_UPDATE_ATTEMPTS):
            head = repo.branch_head(ref)
            if header.parent is not None and header.parent != head:
                raise HubError(412, "ParentCommitMismatch",
                               f"A commit has happened since {header.parent}: {ref} is at {head}. "
                               "Refresh and try again.")
            commit = build_commit(repo, head, header, operations, blob_ids)
            if repo.compare_and_swap(ref, commit, head):
                return commit
        raise HubError(409, "CommitConflict", f"{ref} kept moving under concurrent commits; try again")

    def open_pull_request(
        self, repo: GitRepo, rev: str, header: CommitHeader, operations: list[Operation]
    ) -> tuple[str, int]:
        """Commit on top of `parentCommit` (default: the head of `rev`) to a new ref refs/pr/<n>; `rev` stays put."""
        base = repo.resolve(header.parent) if header.parent else repo.branch_head(branch_ref(rev))
        commit = build_commit(repo, base, header, operations, write_operation_blobs(repo, operations))
        for _ in range(REF_UPDATE_ATTEMPTS):
            numbers = [int(match[1]) for ref in repo.refs() if (match := PULL_REQUEST_REF_RE.fullmatch(ref))]
            number = max(numbers, default=0) + 1
            if repo.compare_and_swap(f"refs/pr/{number}", commit, ""):
                return commit, number
        raise HubError(409, "CommitConflict", "Pull requests kept being opened concurrently; try again")

    def create_branch(self, request: Request, repo_type: str, org: str, name: str, branch: str) -> Reply:
        repo = self.open_repo(repo_type, org, name)
        check_new_ref_name(branch, "branch")
        start = request.json().get("startingPoint") or "main"
        if not isinstance(start, str):
            raise bad_request("'startingPoint' must be a revision string")
        if not repo.compare_and_swap(f"refs/heads/{branch}", repo.resolve(start), ""):
            raise HubError(409, "BranchExists", f"Reference already exists: refs/heads/{branch}")
        return Reply({})

    def delete_branch(self, request: Request, repo_type: str, org: str, name: str, branch: str) -> Reply:
        if branch == "main":
            raise HubError(403, "Forbidden", "The default branch 'main' cannot be deleted")
        self.delete_ref(self.open_repo(repo_type, org, name), f"refs/heads/{branch}", branch)
        return Reply({})

    def create_tag(self, request: Request, repo_type: str, org: str, name: str, rev: str) -> Reply:
        repo = self.open_repo(repo_type, org, name)
        payload = request.json()
        tag = check_new_ref_name(payload.get("tag"), "tag")
        commit = repo.resolve(rev)
        message = payload.get("message")
        target = repo.make_tag(commit, tag, message) if isinstance(message, str) and message.strip() else commit
        if not repo.compare_and_swap(f"refs/tags/{tag}", target, ""):
            raise HubError(409, "TagExists", f"Tag {tag!r} already exists")
        return Reply({})

    def delete_tag(self, request: Request, repo_type: str, org: str, name: str, tag: str) -> Reply:
        self.delete_ref(self.open_repo(repo_type, org, name), f"refs/tags/{tag}", tag)
        return Reply({})

    def resolve(self, request: Request, repo_type: str, org: str, name: str, rev: str, path: str) -> Reply:
        repo = self.open_repo(repo_type, org, name)
        check_file_path(path)
        commit = repo.resolve(rev)
        entry = repo.snapshot(commit).get(path)
        if entry is None or entry.kind != "file":
            raise entry_not_found(f"File {path!r} not found at {commit}", commit)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{entry.oid}"', "Content-Length": str(entry.size),
                   "Content-Type": "application/octet-stream"}
        return Reply(headers=headers, stream=lambda out: repo.copy_blob(entry.oid, out))

    # -- helpers

    @staticmethod
    def delete_ref(repo: GitRepo, ref: str, short_name: str) -> None:
        current = repo.ref_value(ref)
        if not current:
            raise revision_not_found(short_name)
        if not repo.compare_and_swap(ref, None, current):
            raise HubError(409, "RefMoved", f"{ref} moved while it was being deleted; try again")


# --------------------------------------------------------------------------------------------------- HTTP


class HubRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every request body is read in full, every reply has a length
    server_version = "kernel-hub"
    timeout = 300  # seconds a connection may sit idle or stall mid-request
    server: "HubHTTPServer"

    def do_GET(self) -> None:
        try:
            reply = self.server.hub.handle(self.parse_request_data())
        except HubError as err:
            reply = err.reply()
        except Exception:
            self.log_error("internal error on %s %s\n%s", self.command, self.path, traceback.format_exc())
            self.close_connection = True  # the request may not have been read in full
            reply = HubError(500, "InternalError", "Internal error in the kernel hub; see its log").reply()
        try:
            self.send_reply(reply)
        except ConnectionError:
            self.close_connection = True

    do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

    def parse_request_data(self) -> Request:
        url = urlsplit(self.path)
        host = self.headers.get("Host") or "{}:{}".format(*self.server.server_address[:2])
        return Request(
            method=self.command,
            segments=[unquote(segment) for segment in url.path.split("/")[1:]],
            query=dict(parse_qsl(url.query, keep_blank_values=True)),
            headers=self.headers,
            body=self.read_body(),
            endpoint=f"http://{host}",
        )

    def read_body(self) -> bytes:
        limit = self.server.hub.max_body_bytes
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True  # the unread body would desynchronise the connection
            raise HubError(411, "LengthRequired", "Send a Content-Length; chunked request bodies are not supported")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= limit:
            self.close_connection = True
            raise HubError(413 if length > limit else 400, "PayloadTooLarge" if length > limit else "BadRequest",
                           f"Request body of {length} bytes: the hub accepts 0 to {limit} bytes")
        return self.rfile.read(length)

    def send_reply(self, reply: Reply) -> None:
        headers = dict(reply.headers)
        body = b""
        if reply.stream is None:
            body = json.dumps(reply.body).encode()
            headers.update({"Content-Type": "application/json", "Content-Length": str(len(body))})
        self.send_response(reply.status)
        for key, value in headers.items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command == "HEAD":
            return
        if reply.stream is None:
            self.wfile.write(body)
        else:
            reply.stream(self.wfile)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if not self.server.quiet:
            super().log_request(code, size)


class HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: KernelHub, host: str, port: int, quiet: bool = False):
        self.hub, self.quiet = hub, quiet
        super().__init__((host, port), HubRequestHandler)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Serve a self-hosted kernel hub (the Hugging Face Hub API subset "
                                                 "that huggingface_hub and kernels use) from a data folder.")
    parser.add_argument("--data", required=True, type=Path, help="folder holding the git repositories")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8808, help="port to bind; 0 picks a free one (default 8808)")
    parser.add_argument("--token", default=os.environ.get("HUB_TOKEN"),
                        help="bearer token that writes need (default: $HUB_TOKEN; none = open writes)")
    parser.add_argument("--trusted-org", dest="trusted_orgs", action="extend", nargs="+", default=[], metavar="ORG",
                        help="org reported as a trusted kernel publisher (repeatable)")
    parser.add_argument("--max-body-mib", type=int, default=DEFAULT_MAX_BODY_BYTES // 2**20,
                        help="largest request body accepted, in MiB (default 512)")
    parser.add_argument("--max-files", type=int, default=DEFAULT_MAX_FILES,
                        help="most operations per commit and files per preupload request (default 10000)")
    parser.add_argument("--quiet", action="store_true", help="log errors only, not every request")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("git") is None:
        print("kernel hub: the git command-line tool is required", file=sys.stderr)
        return 2
    for org in args.trusted_orgs:
        check_repo_part(org, "namespace")
    args.data.mkdir(parents=True, exist_ok=True)
    hub = KernelHub(args.data, token=args.token, trusted_orgs=tuple(args.trusted_orgs),
                    max_body_bytes=args.max_body_mib * 2**20, max_files=args.max_files)
    server = HubHTTPServer(hub, args.host, args.port, quiet=args.quiet)

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    host, port = server.server_address[:2]
    if not hub.token and host not in ("127.0.0.1", "localhost"):
        print(f"kernel hub: WARNING: bound to {host} without --token: anyone who can reach it can write",
              file=sys.stderr)
    # running_hub() reads this line to learn the port.
    print(f"kernel hub: serving {hub.data_dir} at http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


# --------------------------------------------------------------------------------------------------- running_hub


@contextlib.contextmanager
def running_hub(
    data_dir: str | os.PathLike,
    *,
    token: str | None = None,
    trusted_orgs: tuple[str, ...] | list[str] = (),
    quiet: bool = True,
    startup_timeout: float = 30.0,
) -> Iterator[str]:
    """Run `scripts/hub.py` on a free loopback port; yield its endpoint URL, `http://127.0.0.1:<port>`.

    The hub's log goes to this process's stderr (errors only when `quiet`). It is stopped on exit.
    """
    command = [sys.executable, str(REPO_ROOT / "scripts" / "hub.py"), "--data", str(data_dir), "--port", "0"]
    for org in trusted_orgs:
        command += ["--trusted-org", org]
    if quiet:
        command.append("--quiet")
    env = {key: value for key, value in os.environ.items() if key != "HUB_TOKEN"}
    if token:
        env["HUB_TOKEN"] = token  # through the environment, so the token is not visible in `ps`
    process = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True)
    try:
        endpoint = _wait_until_serving(process, startup_timeout)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


def _wait_until_serving(process: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    line = ""
    while not line and time.monotonic() < deadline and process.poll() is None:
        if select.select([process.stdout], [], [], 0.1)[0]:
            line = process.stdout.readline()
    found = re.search(r"http://\S+", line)
    if not found:
        raise RuntimeError(f"the kernel hub did not start (exit code {process.poll()}, output {line!r})")
    endpoint = found.group(0)
    host, port = urlsplit(endpoint).hostname, urlsplit(endpoint).port
    while True:
        connection = http.client.HTTPConnection(host, port, timeout=5)  # direct: proxy settings do not apply
        try:
            connection.request("GET", "/api/organizations/probe/overview")
            if connection.getresponse().status == 200:
                return endpoint
        except OSError:
            pass
        finally:
            connection.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the kernel hub at {endpoint} does not answer")
        time.sleep(0.05)
