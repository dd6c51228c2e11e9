"""Commits as clients send them: the NDJSON commit payload and the preupload file list, parsed and checked in
full before anything is written, then landed on a ref in one compare-and-swap.

A commit is all-or-nothing: its blobs and tree are written first, unreferenced, and only the final
`update-ref` makes it visible; a ref that moved meanwhile makes it rebuild on the new head (or fail with
ParentCommitMismatch when the client named the parent it expects).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, NamedTuple

from .errors import HubError, bad_request, entry_not_found
from .storage import COMMIT_RE, PULL_REQUEST_REF_RE, REF_UPDATE_ATTEMPTS, Entry, GitRepo, branch_ref, check_file_path


class Operation(NamedTuple):
    kind: str  # "file", "deletedFile" or "deletedFolder"
    path: str
    content: bytes | None = None


class CommitHeader(NamedTuple):
    summary: str
    description: str
    parent: str | None


# --------------------------------------------------------------------------------------------------- payloads


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


def parse_preupload_payload(payload: dict, max_files: int) -> list[str]:
    """The file paths of a preupload request's `files` list."""
    files = payload.get("files")
    if not isinstance(files, list) or len(files) > max_files:
        raise bad_request(f"'files' must be a list of at most {max_files} entries")
    return [check_file_path(item.get("path") if isinstance(item, dict) else None) for item in files]


# --------------------------------------------------------------------------------------------------- landing


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


def land_commit(repo: GitRepo, ref: str, header: CommitHeader, operations: list[Operation]) -> str:
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


def open_pull_request(repo: GitRepo, rev: str, header: CommitHeader, operations: list[Operation]) -> tuple[str, int]:
    """Commit on top of `parentCommit` (default: the head of `rev`) to a new ref refs/pr/<n>; `rev` stays put."""
    base = repo.resolve(header.parent) if header.parent else repo.branch_head(branch_ref(rev))
    commit = build_commit(repo, base, header, operations, write_operation_blobs(repo, operations))
    for _ in range(REF_UPDATE_ATTEMPTS):
        numbers = [int(match[1]) for ref in repo.refs() if (match := PULL_REQUEST_REF_RE.fullmatch(ref))]
        number = max(numbers, default=0) + 1
        if repo.compare_and_swap(f"refs/pr/{number}", commit, ""):
            return commit, number
    raise HubError(409, "CommitConflict", "Pull requests kept being opened concurrently; try again")
