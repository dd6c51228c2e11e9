"""The Hub's HTTP API, independent of the HTTP server: `KernelHub.handle(request)` finds the route in `ROUTES`, a
table of URL patterns bound to the handler functions below, and returns the reply.

It serves the endpoints, headers and error codes that huggingface_hub 2.4.0 and kernels 0.17.2 rely on, for
`kernel` repos and, at no extra cost, `model` repos (tests/test_hub_server.py holds the conformance tests).
Writes need `Authorization: Bearer <token>` when the hub has a token; reads are open.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import Any, BinaryIO, Callable, NamedTuple

from .commits import land_commit, open_pull_request, parse_commit_payload, parse_preupload_payload
from .errors import HubError, bad_request, entry_not_found
from .storage import RepoStore, branch_ref, check_file_path, check_new_ref_name, check_repo_part, iso_time

REPO_TYPES = {"kernels": "kernel", "models": "model"}  # API path segment -> repo type
URL_PREFIXES = {"kernel": "kernels/", "model": ""}  # repo type -> prefix of its web and resolve URLs
DEFAULT_MAX_BODY_BYTES = 512 * 2**20
DEFAULT_MAX_FILES = 10_000  # operations per commit, and files per preupload request
TRUE_VALUES = {"1", "true", "True"}


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


def error_reply(error: HubError) -> Reply:
    """The Hub's error reply: status, `X-Error-Code`, `X-Error-Message` and a JSON `error` body."""
    # Header values must be single-line latin-1; the JSON body keeps the exact text.
    header_message = " ".join(error.message.encode("ascii", "replace").decode().split())
    headers = {"X-Error-Code": error.code, "X-Error-Message": header_message, **error.headers}
    return Reply({"error": error.message, **error.extra}, status=error.status, headers=headers)


class KernelHub:
    """The Hub API over a data folder: its settings and its repo store; `handle` answers one request."""

    def __init__(
        self,
        data_dir: Path,
        *,
        token: str | None = None,
        trusted_orgs: tuple[str, ...] = (),
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_files: int = DEFAULT_MAX_FILES,
    ):
        self.store = RepoStore(data_dir)
        self.token = token or None
        self.trusted_orgs = frozenset(trusted_orgs)
        self.max_body_bytes = max_body_bytes
        self.max_files = max_files

    def handle(self, request: Request) -> Reply:
        if request.method not in ("GET", "HEAD"):
            self.authorize(request)
        method = "GET" if request.method == "HEAD" else request.method
        for candidate in ROUTES:
            if candidate.method == method and (params := candidate.match(request.segments)) is not None:
                return candidate.handler(self, request, **params)
        raise HubError(404, "NotFound", f"No endpoint {request.method} /{'/'.join(request.segments)} on this hub")

    def authorize(self, request: Request) -> None:
        if self.token is None:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise HubError(401, "Unauthorized", "Writes need an 'Authorization: Bearer <token>' header (set HF_TOKEN)")
        if not hmac.compare_digest(token.strip().encode(), self.token.encode()):
            raise HubError(401, "Unauthorized", "Invalid credentials in Authorization header")


def repo_url(request: Request, repo_type: str, org: str, name: str) -> str:
    return f"{request.endpoint}/{URL_PREFIXES[repo_type]}{org}/{name}"


# --------------------------------------------------------------------------------------------------- handlers


def create_repo(hub: KernelHub, request: Request) -> Reply:
    payload = request.json()
    repo_type = payload.get("type") or "model"
    if not isinstance(repo_type, str) or repo_type not in URL_PREFIXES:
        raise bad_request(f"Repo type {repo_type!r} is not served here; use one of {sorted(URL_PREFIXES)}")
    if payload.get("private") or payload.get("visibility") not in (None, "public"):
        raise bad_request("This hub serves public repos only: every read is open")
    org, name = payload.get("organization"), payload.get("name")
    if not org:
        raise bad_request("Give the repo id with its namespace, '<org>/<name>'")
    if not hub.store.create(repo_type, org, name):
        # The client reads `url` from the 409 body when exist_ok=True.
        raise HubError(409, "RepoExists", f"You already created this {repo_type} repo: {org}/{name}",
                       extra={"url": repo_url(request, repo_type, org, name)})
    return Reply({"url": repo_url(request, repo_type, org, name), "name": f"{org}/{name}"})


def validate_yaml(hub: KernelHub, request: Request) -> Reply:
    return Reply({"errors": [], "warnings": []})


def organization_overview(hub: KernelHub, request: Request, org: str) -> Reply:
    check_repo_part(org, "namespace")
    trusted = org in hub.trusted_orgs
    return Reply({"name": org, "fullname": org, "avatarUrl": "", "trustedKernelPublisher": trusted})


def repo_info(hub: KernelHub, request: Request, repo_type: str, org: str, name: str, rev: str = "main") -> Reply:
    repo = hub.store.open(repo_type, org, name)
    commit = repo.resolve(rev)
    files = [path for path, entry in repo.snapshot(commit).items() if entry.kind == "file"]
    return Reply({
        "id": f"{org}/{name}", "author": org, "sha": commit, "private": False, "disabled": False,
        "gated": False, "lastModified": iso_time(repo.commit_time(commit)), "tags": [],
        "siblings": [{"rfilename": path} for path in files],
    })


def list_refs(hub: KernelHub, request: Request, repo_type: str, org: str, name: str) -> Reply:
    refs = hub.store.open(repo_type, org, name).refs()

    def refs_under(prefix: str) -> list[dict]:
        return [{"name": ref[len(prefix):], "ref": ref, "targetCommit": commit}
                for ref, commit in refs.items() if ref.startswith(prefix)]

    pull_requests = [{"name": ref, "ref": ref, "targetCommit": commit}
                     for ref, commit in refs.items() if ref.startswith("refs/pr/")]
    return Reply({"branches": refs_under("refs/heads/"), "tags": refs_under("refs/tags/"),
                  "converts": [], "pullRequests": pull_requests})


def list_tree(hub: KernelHub, request: Request, repo_type: str, org: str, name: str, rev: str, path: str) -> Reply:
    repo = hub.store.open(repo_type, org, name)
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


def list_commits(hub: KernelHub, request: Request, repo_type: str, org: str, name: str, rev: str) -> Reply:
    repo = hub.store.open(repo_type, org, name)
    return Reply(repo.log(repo.resolve(rev)))


def preupload(hub: KernelHub, request: Request, repo_type: str, org: str, name: str, rev: str) -> Reply:
    repo = hub.store.open(repo_type, org, name)
    paths = parse_preupload_payload(request.json(), hub.max_files)
    snapshot = repo.snapshot(repo.resolve(rev))
    answers = []
    for path in paths:
        current = snapshot.get(path)
        # Always "regular": content travels inline in the commit, never through LFS or Xet.
        answers.append({"path": path, "uploadMode": "regular", "shouldIgnore": False,
                        "oid": current.oid if current and current.kind == "file" else None})
    return Reply({"files": answers})


def commit(hub: KernelHub, request: Request, repo_type: str, org: str, name: str, rev: str) -> Reply:
    repo = hub.store.open(repo_type, org, name)
    header, operations = parse_commit_payload(request.body, hub.max_files)
    url = repo_url(request, repo_type, org, name)
    pull_request_url = None
    with hub.store.locked(repo.git_dir):
        if request.query.get("create_pr") in TRUE_VALUES:
            commit_id, number = open_pull_request(repo, rev, header, operations)
            pull_request_url = f"{url}/discussions/{number}"  # the client derives refs/pr/<n> from it
        else:
            commit_id = land_commit(repo, branch_ref(rev), header, operations)
    return Reply({"commitUrl": f"{url}/commit/{commit_id}", "commitOid": commit_id,
                  "pullRequestUrl": pull_request_url})


def create_branch(hub: KernelHub, request: Request, repo_type: str, org: str, name: str, branch: str) -> Reply:
    repo = hub.store.open(repo_type, org, name)
    check_new_ref_name(branch, "branch")
    start = request.json().get("startingPoint") or "main"
    if not isinstance(start, str):
        raise bad_request("'startingPoint' must be a revision string")
    if not repo.compare_and_swap(f"refs/heads/{branch}", repo.resolve(start), ""):
        raise HubError(409, "BranchExists", f"Reference already exists: refs/heads/{branch}")
    return Reply({})


def delete_branch(hub: KernelHub, request: Request, repo_type: str, org: str, name: str, branch: str) -> Reply:
    if branch == "main":
        raise HubError(403, "Forbidden", "The default branch 'main' cannot be deleted")
    hub.store.open(repo_type, org, name).delete_ref(f"refs/heads/{branch}", branch)
    return Reply({})


def create_tag(hub: KernelHub, request: Request, repo_type: str, org: str, name: str, rev: str) -> Reply:
    repo = hub.store.open(repo_type, org, name)
    payload = request.json()
    tag = check_new_ref_name(payload.get("tag"), "tag")
    commit_id = repo.resolve(rev)
    message = payload.get("message")
    target = repo.make_tag(commit_id, tag, message) if isinstance(message, str) and message.strip() else commit_id
    if not repo.compare_and_swap(f"refs/tags/{tag}", target, ""):
        raise HubError(409, "TagExists", f"Tag {tag!r} already exists")
    return Reply({})


def delete_tag(hub: KernelHub, request: Request, repo_type: str, org: str, name: str, tag: str) -> Reply:
    hub.store.open(repo_type, org, name).delete_ref(f"refs/tags/{tag}", tag)
    return Reply({})


def resolve(hub: KernelHub, request: Request, repo_type: str, org: str, name: str, rev: str, path: str) -> Reply:
    repo = hub.store.open(repo_type, org, name)
    check_file_path(path)
    commit_id = repo.resolve(rev)
    entry = repo.snapshot(commit_id).get(path)
    if entry is None or entry.kind != "file":
        raise entry_not_found(f"File {path!r} not found at {commit_id}", commit_id)
    headers = {"X-Repo-Commit": commit_id, "ETag": f'"{entry.oid}"', "Content-Length": str(entry.size),
               "Content-Type": "application/octet-stream"}
    return Reply(headers=headers, stream=lambda out: repo.copy_blob(entry.oid, out))


# --------------------------------------------------------------------------------------------------- routes


Handler = Callable[..., Reply]  # handler(hub, request, **params from the URL pattern and the route's fixed values)


class Route(NamedTuple):
    method: str
    pattern: tuple[str, ...]  # literal segments, "{name}" for one segment, "{name*}" for all remaining ones
    handler: Handler
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


def route(method: str, pattern: str, handler: Handler, **fixed) -> Route:
    return Route(method, tuple(pattern.split("/")), handler, fixed)


REPO = "api/{repo_type}/{org}/{name}"
ROUTES = [
    route("POST", "api/repos/create", create_repo),
    route("POST", "api/validate-yaml", validate_yaml),
    route("GET", "api/organizations/{org}/overview", organization_overview),
    route("GET", REPO, repo_info),
    route("GET", REPO + "/revision/{rev}", repo_info),
    route("GET", REPO + "/refs", list_refs),
    route("GET", REPO + "/tree/{rev}/{path*}", list_tree),
    route("GET", REPO + "/commits/{rev}", list_commits),
    route("POST", REPO + "/preupload/{rev}", preupload),
    route("POST", REPO + "/commit/{rev}", commit),
    route("POST", REPO + "/branch/{branch}", create_branch),
    route("DELETE", REPO + "/branch/{branch}", delete_branch),
    route("POST", REPO + "/tag/{rev}", create_tag),
    route("DELETE", REPO + "/tag/{tag}", delete_tag),
    route("GET", "kernels/{org}/{name}/resolve/{rev}/{path*}", resolve, repo_type="kernel"),
    route("GET", "{org}/{name}/resolve/{rev}/{path*}", resolve, repo_type="model"),
]
