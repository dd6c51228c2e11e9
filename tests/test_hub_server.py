"""Conformance tests for the self-hosted kernel hub (hubtools/hub/).

Everything runs against the real server process on loopback (`running_hub`) with the real clients,
huggingface_hub 2.4.0 and kernels 0.17.2, following the Hub API contract the two clients rely on.

How the clients are pointed at the hub, and why:
- `HfApi` runs in this process, built as `HfApi(endpoint=hub)`. HfApi threads its own endpoint into API URLs and
  into download (`resolve`) URLs, so it does not depend on `HF_ENDPOINT`, which huggingface_hub freezes at import
  (another test module may import it first). The only global it still reads is `constants.ENDPOINT`, for the
  User-Agent side call to `/api/agent-harnesses`; the module fixture patches it, together with
  `HUGGINGFACE_CO_URL_TEMPLATE`, so that nothing leaves the machine.
- `kernels` runs in subprocesses: it builds `HfApi()` without an endpoint and reads `KERNELS_CACHE` once at import,
  so a fresh interpreter with the environment set first is the only faithful way to run it.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, constants
from huggingface_hub.errors import (
    BadRequestError,
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder

from hubtools.hub.server import running_hub

TOKEN = "test-token"
ORG = "test-org"
TRUSTED_ORG = "trusted-org"
UNTRUSTED_ORG = "untrusted-org"


# --------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def hub_data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hub") / "data"


@pytest.fixture(scope="module")
def hub(hub_data) -> str:
    with running_hub(hub_data, token=TOKEN, trusted_orgs=[TRUSTED_ORG]) as endpoint, pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "ENDPOINT", endpoint)
        mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        yield endpoint


@pytest.fixture(scope="module")
def api(hub) -> HfApi:
    return HfApi(endpoint=hub, token=TOKEN)


def make_repo(api: HfApi, name: str, org: str = ORG) -> str:
    repo_id = f"{org}/{name}"
    api.create_repo(repo_id, repo_type="kernel")
    return repo_id


def head(api: HfApi, repo_id: str, branch: str = "main") -> str:
    return next(b.target_commit for b in api.list_repo_refs(repo_id, repo_type="kernel").branches if b.name == branch)


def git(hub_data: Path, repo_id: str, *args: str) -> str:
    git_dir = hub_data / "kernels" / f"{repo_id}.git"
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, text=True, check=True).stdout


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def raw_request(endpoint: str, method: str, path: str, body: bytes = b"", token: str | None = TOKEN):
    """One plain HTTP request, for inputs the client library would refuse to send."""
    url = urlsplit(endpoint)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def ndjson_commit(*operations: dict, summary: str = "raw commit") -> bytes:
    lines = [{"key": "header", "value": {"summary": summary, "description": ""}}, *operations]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


# --------------------------------------------------------------------------------------------------- repos, refs


def test_create_repo_is_a_git_repo_and_exist_ok_accepts_the_conflict(api, hub, hub_data):
    url = api.create_repo(f"{ORG}/created", repo_type="kernel")
    assert url == f"{hub}/kernels/{ORG}/created"
    assert url.repo_id == f"{ORG}/created" and url.repo_type == "kernel"

    with pytest.raises(HfHubHTTPError) as conflict:
        api.create_repo(f"{ORG}/created", repo_type="kernel")
    assert conflict.value.response.status_code == 409
    assert api.create_repo(f"{ORG}/created", repo_type="kernel", exist_ok=True) == url

    # A real bare git repo with the Hub's initial commit on main.
    assert git(hub_data, f"{ORG}/created", "log", "--format=%s", "main").split("\n")[0] == "initial commit"
    assert api.list_repo_files(f"{ORG}/created", repo_type="kernel") == [".gitattributes"]


def test_branches_tags_and_refs(api):
    repo_id = make_repo(api, "refs")
    main = head(api, repo_id)
    api.create_branch(repo_id, branch="v1", repo_type="kernel")
    api.create_branch(repo_id, branch="v1", repo_type="kernel", exist_ok=True)
    with pytest.raises(HfHubHTTPError) as conflict:
        api.create_branch(repo_id, branch="v1", repo_type="kernel")
    assert conflict.value.response.status_code == 409
    with pytest.raises(RevisionNotFoundError):
        api.create_branch(repo_id, branch="v2", revision="no-such-branch", repo_type="kernel")

    api.create_tag(repo_id, tag="v1.0.0", revision="v1", tag_message="first release", repo_type="kernel")
    api.create_tag(repo_id, tag="light", revision=main, repo_type="kernel")
    with pytest.raises(HfHubHTTPError) as conflict:
        api.create_tag(repo_id, tag="light", repo_type="kernel")
    assert conflict.value.response.status_code == 409

    refs = api.list_repo_refs(repo_id, repo_type="kernel", include_pull_requests=True)
    assert {(b.name, b.ref, b.target_commit) for b in refs.branches} == {
        ("main", "refs/heads/main", main), ("v1", "refs/heads/v1", main)}
    # The annotated tag is reported by the commit it points at.
    assert {(t.name, t.target_commit) for t in refs.tags} == {("v1.0.0", main), ("light", main)}
    assert refs.converts == [] and refs.pull_requests == []
    assert api.kernel_info(repo_id, revision="v1.0.0").sha == main

    api.delete_branch(repo_id, branch="v1", repo_type="kernel")
    api.delete_tag(repo_id, tag="light", repo_type="kernel")
    refs = api.list_repo_refs(repo_id, repo_type="kernel")
    assert [b.name for b in refs.branches] == ["main"] and [t.name for t in refs.tags] == ["v1.0.0"]
    with pytest.raises(RevisionNotFoundError):
        api.delete_branch(repo_id, branch="v1", repo_type="kernel")
    # Names git refuses, or that a git command line would read as an option.
    for bad in ("a..b", "--help", "-v1"):
        with pytest.raises(BadRequestError):
            api.create_branch(repo_id, branch=bad, repo_type="kernel")
        with pytest.raises(BadRequestError):
            api.create_tag(repo_id, tag=bad, repo_type="kernel")


# --------------------------------------------------------------------------------------------------- commits


def test_commit_adds_and_deletes(api, hub_data, tmp_path):
    repo_id = make_repo(api, "commits")
    binary = bytes(range(256)) * 64
    first = api.create_commit(
        repo_id,
        [
            CommitOperationAdd("build/torch-cpu/__init__.py", b"def f():\n    return 1\n"),
            CommitOperationAdd("build/torch-cpu/data.bin", binary),
            CommitOperationAdd("build/torch-cuda/__init__.py", b"x = 1\n"),
            CommitOperationAdd("docs/a b/notes.txt", b"spaces in folder names\n"),
        ],
        commit_message="add builds",
        commit_description="two variants",
        repo_type="kernel",
    )
    assert first.oid == head(api, repo_id)
    second = api.create_commit(
        repo_id,
        [CommitOperationDelete("build/torch-cuda/"), CommitOperationDelete("docs/a b/notes.txt"),
         CommitOperationAdd("build/torch-cpu/__init__.py", b"def f():\n    return 2\n")],
        commit_message="drop cuda",
        repo_type="kernel",
    )
    assert api.list_repo_files(repo_id, repo_type="kernel") == [
        ".gitattributes", "build/torch-cpu/__init__.py", "build/torch-cpu/data.bin"]
    downloaded = api.hf_hub_download(repo_id, "build/torch-cpu/data.bin", repo_type="kernel", cache_dir=tmp_path)
    assert Path(downloaded).read_bytes() == binary
    old = api.hf_hub_download(repo_id, "build/torch-cpu/__init__.py", repo_type="kernel", revision=first.oid,
                              cache_dir=tmp_path)
    assert Path(old).read_text().endswith("return 1\n")

    commits = api.list_repo_commits(repo_id, repo_type="kernel")
    assert [(c.commit_id, c.title) for c in commits[:2]] == [(second.oid, "drop cuda"), (first.oid, "add builds")]
    assert commits[1].message == "two variants"
    assert git(hub_data, repo_id, "log", "--format=%H", "main").split() == [c.commit_id for c in commits]

    with pytest.raises(EntryNotFoundError):
        api.create_commit(repo_id, [CommitOperationDelete("no/such/file.py")], commit_message="x", repo_type="kernel")
    assert head(api, repo_id) == second.oid


def test_upload_folder_tree_listing_and_no_op_reupload(api, tmp_path):
    repo_id = make_repo(api, "folder")
    api.create_branch(repo_id, branch="v1", repo_type="kernel")
    folder = tmp_path / "upload"
    files = {"build/torch-cpu/__init__.py": b"y = 2\n", "build/torch-cpu/metadata.json": b"{}\n",
             "build/torch-cuda/__init__.py": b"", "benchmarks/benchmark.py": b"# bench\n"}
    for path, data in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)

    upload = api.upload_folder(repo_id=repo_id, folder_path=folder, revision="v1", repo_type="kernel",
                               commit_message="publish")
    assert upload.oid == head(api, repo_id, "v1")
    commits_before = len(api.list_repo_commits(repo_id, repo_type="kernel", revision="v1"))

    again = api.upload_folder(repo_id=repo_id, folder_path=folder, revision="v1", repo_type="kernel",
                              commit_message="publish again")
    assert again.oid == upload.oid
    assert len(api.list_repo_commits(repo_id, repo_type="kernel", revision="v1")) == commits_before

    variants = list(api.list_repo_tree(repo_id, path_in_repo="build", revision="v1", repo_type="kernel"))
    assert all(isinstance(item, RepoFolder) for item in variants)
    assert sorted(item.path for item in variants) == ["build/torch-cpu", "build/torch-cuda"]
    listing = {item.path: item for item in api.list_repo_tree(repo_id, revision="v1", repo_type="kernel",
                                                               recursive=True)}
    for path, data in files.items():
        assert isinstance(listing[path], RepoFile)
        assert (listing[path].size, listing[path].blob_id) == (len(data), git_blob_id(data))
    assert isinstance(listing["build"], RepoFolder) and isinstance(listing["benchmarks"], RepoFolder)
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree(repo_id, path_in_repo="nowhere", revision="v1", repo_type="kernel"))


def test_create_pr_opens_a_pull_request_ref_and_leaves_the_branch(api, tmp_path):
    repo_id = make_repo(api, "pulls")
    api.create_branch(repo_id, branch="v1", repo_type="kernel")
    v1 = head(api, repo_id, "v1")
    first = api.create_commit(repo_id, [CommitOperationAdd("build/torch-cpu/__init__.py", b"p = 1\n")],
                              commit_message="proposal", revision="v1", create_pr=True, repo_type="kernel")
    assert (first.pr_revision, first.pr_num) == ("refs/pr/1", 1)
    second = api.create_commit(repo_id, [CommitOperationAdd("other.py", b"o")], commit_message="another",
                               revision="v1", create_pr=True, repo_type="kernel")
    assert second.pr_revision == "refs/pr/2"
    update = api.create_commit(repo_id, [CommitOperationAdd("build/torch-cpu/__init__.py", b"p = 2\n")],
                               commit_message="revise", revision="refs/pr/1", repo_type="kernel")

    refs = api.list_repo_refs(repo_id, repo_type="kernel", include_pull_requests=True)
    assert head(api, repo_id, "v1") == v1
    assert {(pr.ref, pr.target_commit) for pr in refs.pull_requests} == {
        ("refs/pr/1", update.oid), ("refs/pr/2", second.oid)}
    path = api.hf_hub_download(repo_id, "build/torch-cpu/__init__.py", revision="refs/pr/1", repo_type="kernel",
                               cache_dir=tmp_path)
    assert Path(path).read_bytes() == b"p = 2\n"


def test_model_repos_are_served_too(api, tmp_path):
    url = api.create_repo(f"{ORG}/a-model")
    assert url == f"{api.endpoint}/{ORG}/a-model"
    api.upload_file(path_or_fileobj=b"{}", path_in_repo="config.json", repo_id=f"{ORG}/a-model")
    assert Path(api.hf_hub_download(f"{ORG}/a-model", "config.json", cache_dir=tmp_path)).read_bytes() == b"{}"
    assert [s.rfilename for s in api.model_info(f"{ORG}/a-model").siblings] == [".gitattributes", "config.json"]


def test_snapshot_download_of_a_branch_records_the_ref(api, tmp_path):
    repo_id = make_repo(api, "snapshot")
    api.create_branch(repo_id, branch="v1", repo_type="kernel")
    commit = api.create_commit(repo_id, [CommitOperationAdd("build/torch-cpu/__init__.py", b"z = 3\n")],
                               commit_message="build", revision="v1", repo_type="kernel").oid
    snapshot = Path(api.snapshot_download(repo_id, repo_type="kernel", revision="v1", cache_dir=tmp_path))
    assert snapshot.name == commit
    assert (snapshot / "build/torch-cpu/__init__.py").read_bytes() == b"z = 3\n"
    # The refs/v1 file is what an offline get_kernel(version=1) needs.
    assert (tmp_path / f"kernels--{ORG}--snapshot" / "refs" / "v1").read_text() == commit


def test_missing_repo_revision_and_file_raise_the_client_exceptions(api, tmp_path):
    repo_id = make_repo(api, "missing")
    with pytest.raises(RepositoryNotFoundError):
        api.list_repo_refs(f"{ORG}/no-such-repo", repo_type="kernel")
    with pytest.raises(RepositoryNotFoundError):
        api.hf_hub_download(f"{ORG}/no-such-repo", "x.py", repo_type="kernel", cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        api.hf_hub_download(repo_id, ".gitattributes", revision="v9", repo_type="kernel", cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        api.kernel_info(repo_id, revision="0" * 40)
    with pytest.raises(RevisionNotFoundError):
        api.create_commit(repo_id, [CommitOperationAdd("a.py", b"a")], commit_message="x", revision="v9",
                          repo_type="kernel")
    with pytest.raises(EntryNotFoundError):
        api.hf_hub_download(repo_id, "build/nothing.py", repo_type="kernel", cache_dir=tmp_path)
    assert not api.revision_exists(repo_id, "v9", repo_type="kernel")
    assert api.revision_exists(repo_id, "main", repo_type="kernel")


# --------------------------------------------------------------------------------------------------- safety


def test_writes_need_the_token_and_refused_writes_change_nothing(api, hub, hub_data):
    repo_id = make_repo(api, "guarded")
    refs_before = git(hub_data, repo_id, "for-each-ref")
    objects_before = git(hub_data, repo_id, "count-objects", "-v")
    for token in ("wrong-token", False):  # False: send no Authorization header at all
        intruder = HfApi(endpoint=hub, token=token)
        attempts = [
            lambda: intruder.create_repo(f"{ORG}/intruder", repo_type="kernel"),
            lambda: intruder.create_branch(repo_id, branch="v1", repo_type="kernel"),
            lambda: intruder.delete_branch(repo_id, branch="main", repo_type="kernel"),
            lambda: intruder.create_tag(repo_id, tag="t", repo_type="kernel"),
            lambda: intruder.create_commit(repo_id, [CommitOperationAdd("evil.py", b"x")], commit_message="x",
                                           repo_type="kernel"),
        ]
        for attempt in attempts:
            with pytest.raises(HfHubHTTPError) as refused:
                attempt()
            assert refused.value.response.status_code == 401
            assert refused.value.response.headers["X-Error-Code"] == "Unauthorized"
        # Reads stay open.
        assert intruder.list_repo_files(repo_id, repo_type="kernel") == [".gitattributes"]
    assert git(hub_data, repo_id, "for-each-ref") == refs_before
    assert git(hub_data, repo_id, "count-objects", "-v") == objects_before
    assert not (hub_data / "kernels" / ORG / "intruder.git").exists()


def test_path_traversal_in_repo_ids_and_file_paths_is_refused(tmp_path):
    data = tmp_path / "data"
    with running_hub(data, token=TOKEN) as endpoint:
        api = HfApi(endpoint=endpoint, token=TOKEN)
        repo_id = make_repo(api, "target")
        main = head(api, repo_id)
        for organization, name in [("..", "x"), (ORG, ".."), (ORG, "../../escape"), ("../..", "escape"),
                                   (ORG, "x/../../y"), (ORG, ".git"), ("/abs", "x"), (ORG, "a\\b")]:
            status, headers, _ = raw_request(endpoint, "POST", "/api/repos/create",
                                             json.dumps({"organization": organization, "name": name,
                                                         "type": "kernel"}).encode())
            assert (status, headers["X-Error-Code"]) == (400, "BadRequest"), (organization, name)
        for path in ["/api/kernels/%2E%2E/x/refs", "/api/kernels/..%2F..%2Fescape/x/refs",
                     f"/kernels/{ORG}/..%2F..%2Fescape/resolve/main/x"]:
            assert raw_request(endpoint, "GET", path)[0] == 400, path

        commit_url = f"/api/kernels/{repo_id}/commit/main"
        for bad_path in ["../escape.py", "/etc/passwd", "a/../../b.py", "a\\b.py", ".git/config", "x/.GIT/hooks",
                         "a//b.py", "./a.py", "", "a/\nb.py"]:
            body = ndjson_commit({"key": "file", "value": {"path": bad_path, "content": "eA==", "encoding": "base64"}})
            status, headers, _ = raw_request(endpoint, "POST", commit_url, body)
            assert (status, headers["X-Error-Code"]) == (400, "BadRequest"), bad_path
        body = ndjson_commit({"key": "deletedFolder", "value": {"path": "../"}})
        assert raw_request(endpoint, "POST", commit_url, body)[0] == 400
        for bad_path in ["..%2F..%2Fescape", "a%2F..%2F..%2Fx", "%2Fetc%2Fpasswd"]:
            status, headers, _ = raw_request(endpoint, "GET", f"/kernels/{repo_id}/resolve/main/{bad_path}")
            assert status == 400, bad_path
        with pytest.raises(BadRequestError):
            api.create_branch(repo_id, branch="../../escape", repo_type="kernel")

        assert head(api, repo_id) == main
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
        assert sorted(p.name for p in data.rglob("*.git")) == ["target.git"]


def test_oversized_request_bodies_are_refused(tmp_path):
    with running_hub(tmp_path / "data", token=TOKEN) as endpoint:
        api = HfApi(endpoint=endpoint, token=TOKEN)
        repo_id = make_repo(api, "big")
        # One byte over the default 512 MiB cap: refused from the Content-Length alone, before reading the body.
        url = urlsplit(endpoint)
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
        connection.putrequest("POST", f"/api/kernels/{repo_id}/commit/main")
        connection.putheader("Authorization", f"Bearer {TOKEN}")
        connection.putheader("Content-Length", str(512 * 2**20 + 1))
        connection.endheaders()
        response = connection.getresponse()
        assert (response.status, response.headers["X-Error-Code"]) == (413, "PayloadTooLarge")
        connection.close()
        assert api.list_repo_files(repo_id, repo_type="kernel") == [".gitattributes"]


def test_restarted_hub_serves_the_same_commits(tmp_path):
    data = tmp_path / "data"
    with running_hub(data, token=TOKEN) as endpoint:
        api = HfApi(endpoint=endpoint, token=TOKEN)
        repo_id = make_repo(api, "durable")
        api.create_branch(repo_id, branch="v1", repo_type="kernel")
        commit = api.create_commit(repo_id, [CommitOperationAdd("build/torch-cpu/__init__.py", b"d = 4\n")],
                                   commit_message="build", revision="v1", repo_type="kernel").oid
        api.create_tag(repo_id, tag="v1.0.0", revision="v1", repo_type="kernel")
        refs_before = api.list_repo_refs(repo_id, repo_type="kernel")
    with running_hub(data, token=TOKEN) as endpoint:
        api = HfApi(endpoint=endpoint, token=TOKEN)
        assert api.list_repo_refs(repo_id, repo_type="kernel") == refs_before
        path = api.hf_hub_download(repo_id, "build/torch-cpu/__init__.py", revision="v1.0.0", repo_type="kernel",
                                   cache_dir=tmp_path / "cache")
        assert Path(path).read_bytes() == b"d = 4\n" and Path(path).parent.parent.parent.name == commit


# --------------------------------------------------------------------------------------------------- concurrency


def test_stale_parent_commit_is_a_conflict_not_a_lost_write(api):
    repo_id = make_repo(api, "parent")
    base = head(api, repo_id)
    winner = api.create_commit(repo_id, [CommitOperationAdd("a.py", b"a")], commit_message="a",
                               parent_commit=base, repo_type="kernel").oid
    with pytest.raises(HfHubHTTPError) as conflict:
        api.create_commit(repo_id, [CommitOperationAdd("b.py", b"b")], commit_message="b", parent_commit=base,
                          repo_type="kernel")
    assert conflict.value.response.status_code == 412
    assert head(api, repo_id) == winner
    assert api.list_repo_files(repo_id, repo_type="kernel") == [".gitattributes", "a.py"]


def race(commit_functions) -> list:
    """Run the functions at the same moment in threads; return each one's result or exception."""
    barrier = threading.Barrier(len(commit_functions))
    outcomes = [None] * len(commit_functions)

    def run(index, function):
        barrier.wait()
        try:
            outcomes[index] = function()
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test inspects
            outcomes[index] = exc

    threads = [threading.Thread(target=run, args=item) for item in enumerate(commit_functions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_racing_commits_on_one_branch_all_land_on_a_linear_history(api, hub_data):
    """Commits without a parent race through this hub and through a second hub process on the same data."""
    repo_id = make_repo(api, "race")
    base = head(api, repo_id)
    with running_hub(hub_data, token=TOKEN) as second_endpoint:
        clients = [api, HfApi(endpoint=second_endpoint, token=TOKEN)]
        outcomes = race([
            lambda i=i: clients[i % 2].create_commit(repo_id, [CommitOperationAdd(f"f{i}.py", b"%d" % i)],
                                                     commit_message=f"c{i}", repo_type="kernel").oid
            for i in range(6)
        ])
    assert all(isinstance(oid, str) for oid in outcomes), outcomes
    # Every commit has exactly one parent and the chain from main reaches the base commit through all of them.
    history = [line.split() for line in git(hub_data, repo_id, "rev-list", "--parents", "main").splitlines()]
    assert [len(parents) for _, *parents in history] == [1] * 6 + [0]
    assert {oid for oid, *_ in history} == set(outcomes) | {base}
    # Commits built in a lost compare-and-swap round stay behind unreferenced; everything else must be sound.
    assert git(hub_data, repo_id, "fsck", "--strict", "--no-progress", "--no-dangling") == ""
    assert api.list_repo_files(repo_id, repo_type="kernel") == [".gitattributes"] + [f"f{i}.py" for i in range(6)]


def test_racing_commits_with_the_same_parent_let_exactly_one_land(api, hub_data):
    repo_id = make_repo(api, "race-parent")
    base = head(api, repo_id)
    with running_hub(hub_data, token=TOKEN) as second_endpoint:
        clients = [api, HfApi(endpoint=second_endpoint, token=TOKEN)]
        outcomes = race([
            lambda i=i: clients[i % 2].create_commit(repo_id, [CommitOperationAdd("same.py", b"%d" % i)],
                                                     commit_message=f"c{i}", parent_commit=base,
                                                     repo_type="kernel").oid
            for i in range(4)
        ])
    winners = [oid for oid in outcomes if isinstance(oid, str)]
    assert len(winners) == 1, outcomes
    assert all(isinstance(exc, HfHubHTTPError) and exc.response.status_code == 412
               for exc in outcomes if not isinstance(exc, str))
    assert git(hub_data, repo_id, "rev-list", "--parents", "main").split("\n")[0].split() == [winners[0], base]


# --------------------------------------------------------------------------------------------------- kernels


TINY_KERNEL = b"def add_one(x):\n    return x + 1\n"


def publish_tiny_kernel(api: HfApi, org: str) -> tuple[str, str]:
    repo_id = make_repo(api, "tiny", org=org)
    api.create_branch(repo_id, branch="v1", repo_type="kernel")
    metadata = {"name": "tiny", "id": f"_tiny_cpu_{org.replace('-', '_')}", "version": 1, "license": "Apache-2.0",
                "python-depends": [], "backend": {"type": "cpu"}}
    commit = api.create_commit(
        repo_id,
        [CommitOperationAdd("build/torch-cpu/metadata.json", json.dumps(metadata).encode()),
         CommitOperationAdd("build/torch-cpu/__init__.py", TINY_KERNEL)],
        commit_message="v1 build", revision="v1", repo_type="kernel",
    ).oid
    return repo_id, commit


def run_kernels(hub: str, cache: Path, code: str) -> str:
    env = {key: value for key, value in os.environ.items()
           # HF_HUB_DISABLE_TELEMETRY breaks kernels 0.17.2's User-Agent (hub-http-api.md section 7).
           if key not in ("HF_HUB_OFFLINE", "HF_TOKEN", "LOCAL_KERNELS", "HF_HUB_DISABLE_TELEMETRY")}
    env.update(HF_ENDPOINT=hub, HF_HOME=str(cache / "hf-home"), KERNELS_CACHE=str(cache / "kernels"))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_get_kernel_loads_from_a_trusted_org_without_trust_remote_code(api, hub, tmp_path):
    repo_id, commit = publish_tiny_kernel(api, TRUSTED_ORG)
    out = run_kernels(hub, tmp_path, f"""
import kernels
k = kernels.get_kernel({repo_id!r}, version=1)
print(k.add_one(41), kernels.has_kernel({repo_id!r}, version=1), k.__file__)
""")
    result, available, module_file = out.split()
    assert (result, available) == ("42", "True")
    assert f"/snapshots/{commit}/build/torch-cpu/__init__.py" in module_file


def test_get_kernel_refuses_an_untrusted_org_without_trust_remote_code(api, hub, tmp_path):
    repo_id, _ = publish_tiny_kernel(api, UNTRUSTED_ORG)
    out = run_kernels(hub, tmp_path, f"""
import kernels
try:
    kernels.get_kernel({repo_id!r}, version=1)
except ValueError as exc:
    print("refused:", exc)
print("allowed:", kernels.get_kernel({repo_id!r}, version=1, trust_remote_code=True).add_one(1))
""")
    assert "refused: Kernel repository 'untrusted-org/tiny' is not from a trusted publisher" in out
    assert "allowed: 2" in out


def test_a_client_resetting_its_connection_is_not_reported_as_a_server_error(tmp_path, capsys):
    """socketserver prints a traceback for any exception a handler raises; a client that closes its keep-alive
    connection (ConnectionResetError while the handler waits for the next request) is not one, other errors are."""
    from hubtools.hub.api import KernelHub
    from hubtools.hub.server import HubHTTPServer

    server = HubHTTPServer(KernelHub(tmp_path / "data"), "127.0.0.1", 0, quiet=True)
    try:
        for error, reported in ((ConnectionResetError(104, "Connection reset by peer"), False),
                                (ValueError("a handler bug"), True)):
            try:
                raise error
            except Exception:
                server.handle_error(None, ("127.0.0.1", 1))
            assert (type(error).__name__ in capsys.readouterr().err) == reported
    finally:
        server.server_close()
