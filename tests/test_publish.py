"""Publishing, version branches and pinning, against the real hub process on loopback.

Every client (publish.py, lock.py, kernels loaders) runs in a fresh process: huggingface_hub freezes
HF_ENDPOINT at import and kernels reads KERNELS_CACHE at import. The tests share one hub and one
scratch copy of the workspace and run in order, each step building on the last, like a maintainer's
release history: publish v1, change and republish, pin, bump to v2.
"""

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from workspace_copy import git_commit, make_scratch_workspace

from hubtools.client_env import client_env
from hubtools.hub.server import running_hub

TOKEN = "test-token"
ORG = "triton-llm"
REPO = f"{ORG}/rmsnorm"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Env:
    """The shared state of the release history: hub, scratch workspace and a client cache."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.data = tmp / "hub-data"
        self.workspace = make_scratch_workspace(tmp / "workspace")
        self.cache = tmp / "cache"
        self.commits: dict[str, str] = {}

    def env(self, token=TOKEN, **extra):
        return {**client_env(self.endpoint, token=token, cache=self.cache), **extra}

    def publish(self, *args, token=TOKEN, check=True):
        result = subprocess.run(
            [sys.executable, str(self.workspace / "scripts" / "publish.py"), *args],
            env=self.env(token=token), capture_output=True, text=True, cwd=self.workspace,
        )
        if check:
            assert result.returncode == 0, result.stdout + result.stderr
        return result

    def client(self, code: str, **extra_env) -> dict:
        """Run client code in a fresh process; it prints one JSON object as its last line."""
        prelude = "import json, torch, kernels, huggingface_hub\nfrom pathlib import Path\n"
        result = subprocess.run(
            [sys.executable, "-c", prelude + textwrap.dedent(code)],
            env=self.env(**extra_env), capture_output=True, text=True,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    def refs(self) -> dict:
        return self.client(f"""
            refs = huggingface_hub.HfApi().list_repo_refs("{REPO}", repo_type="kernel")
            print(json.dumps({{b.name: b.target_commit for b in refs.branches}}))
        """)

    def load(self, how: str, trust: str = "False") -> dict:
        """Load rmsnorm with get_kernel(**how), run it, report the commit it came from and its namespace."""
        return self.client(f"""
            k = kernels.get_kernel("{REPO}", {how}, trust_remote_code={trust})
            y = k.rms_norm(torch.randn(3, 16), torch.rand(16))
            print(json.dumps({{"commit": Path(k.__file__).parents[2].name, "id": k.__name__,
                               "finite": bool(torch.isfinite(y).all())}}))
        """)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    env = Env(tmp_path_factory.mktemp("publish"))
    with running_hub(env.data, token=TOKEN, trusted_orgs=[ORG]) as endpoint:
        env.endpoint = endpoint
        yield env


def _edit_and_commit(workspace: Path, relative: str, old: str, new: str, message: str) -> None:
    path = workspace / relative
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    git_commit(workspace, message)


def test_publish_v1_then_get_kernel_runs_it(hub):
    out = hub.publish("rmsnorm").stdout
    refs = hub.refs()
    assert set(refs) == {"main", "v1"}
    assert f'get_kernel("{REPO}", revision="{refs["v1"]}")' in out
    loaded = hub.load("version=1")
    assert loaded["commit"] == refs["v1"] and loaded["finite"]
    hub.commits["first"] = refs["v1"]
    files = hub.client(f"""
        api = huggingface_hub.HfApi()
        print(json.dumps({{"v1": api.list_repo_files("{REPO}", repo_type="kernel", revision="v1"),
                           "main": api.list_repo_files("{REPO}", repo_type="kernel", revision="main")}}))
    """)
    variants = {p.split("/")[1] for p in files["v1"] if p.startswith("build/")}
    assert variants == {"torch-cpu", "torch-cuda", "torch-rocm", "torch-xpu"}
    assert "benchmarks/benchmark.py" in files["v1"] and "README.md" in files["main"]


def test_lock_pins_the_published_commit(hub):
    project = hub.tmp / "downstream"
    project.mkdir()
    (project / "pyproject.toml").write_text(f'[tool.kernels.dependencies]\n"{REPO}" = 1\n')
    subprocess.run(
        [sys.executable, str(hub.workspace / "scripts" / "lock.py"), str(project)],
        env=hub.env(), check=True, capture_output=True,
    )
    lock = json.loads((project / "kernels.lock").read_text())
    assert lock == [{"dependency": {"repo-id": REPO, "version": 1}, "lock": {"commit": hub.commits["first"]}}]
    hub.lockfile = project / "kernels.lock"


def test_republishing_unchanged_source_makes_no_commit(hub):
    out = hub.publish("rmsnorm").stdout
    assert "build unchanged: no commit" in out
    assert hub.refs()["v1"] == hub.commits["first"]


def test_dry_run_writes_nothing(hub):
    _edit_and_commit(hub.workspace, "rmsnorm/torch-ext/rmsnorm/__init__.py", '"""', '"""Edited. ', "edit docs")
    before = hub.refs()
    out = hub.publish("rmsnorm", "--dry-run").stdout
    assert "  change build/torch-cpu/__init__.py" in out
    assert hub.refs() == before


def test_dirty_tree_is_refused(hub):
    init = hub.workspace / "rmsnorm" / "torch-ext" / "rmsnorm" / "__init__.py"
    original = init.read_text()
    init.write_text(original + "\n# uncommitted\n")
    try:
        result = hub.publish("rmsnorm", check=False)
        assert result.returncode != 0 and "uncommitted changes" in result.stderr
    finally:
        init.write_text(original)


def test_a_set_with_one_failing_kernel_publishes_none(hub):
    """rmsnorm has a committed change ready to publish; moe-dispatch fails its checks: neither is written."""
    _edit_and_commit(hub.workspace, "rmsnorm/torch-ext/rmsnorm/__init__.py", '"""', '"""Set. ', "ready to publish")
    broken = hub.workspace / "moe-dispatch" / "torch-ext" / "moe_dispatch" / "__init__.py"
    original = broken.read_text()
    broken.write_text(original + "\n# uncommitted\n")
    before = hub.refs()
    try:
        result = hub.publish("rmsnorm", "moe-dispatch", check=False)
    finally:
        broken.write_text(original)
    assert result.returncode != 0
    assert "nothing was published" in result.stderr and "moe-dispatch: " in result.stderr
    assert hub.refs() == before
    missing = hub.client("""
        api = huggingface_hub.HfApi()
        print(json.dumps({"exists": api.repo_exists("triton-llm/moe-dispatch", repo_type="kernel")}))
    """)
    assert missing == {"exists": False}


def test_wrong_or_missing_token_is_refused_and_nothing_written(hub):
    before = hub.refs()
    for token in ("wrong-token", ""):
        result = hub.publish("rmsnorm", token=token, check=False)
        assert result.returncode != 0
    assert hub.refs() == before


def test_republish_moves_version_but_not_pins(hub):
    hub.publish("rmsnorm")
    refs = hub.refs()
    assert refs["v1"] != hub.commits["first"]
    hub.commits["second"] = refs["v1"]
    assert hub.load("version=1")["commit"] == hub.commits["second"]
    assert hub.load(f'revision="{hub.commits["first"]}"')["commit"] == hub.commits["first"]
    locked = hub.client(f"""
        k = kernels.get_locked_kernel("{REPO}", lockfile=Path("{hub.lockfile}"))
        print(json.dumps({{"commit": Path(k.__file__).parents[2].name}}))
    """)
    assert locked["commit"] == hub.commits["first"]
    subprocess.run(
        [sys.executable, str(hub.workspace / "scripts" / "lock.py"), str(hub.lockfile.parent), "--download"],
        env=hub.env(), check=True, capture_output=True,
    )
    offline = hub.client(
        f"""
        k = kernels.load_kernel("{REPO}", lockfile=Path("{hub.lockfile}"))
        print(json.dumps({{"commit": Path(k.__file__).parents[2].name}}))
        """,
        HF_HUB_OFFLINE="1",
    )
    assert offline["commit"] == hub.commits["first"]


def test_every_pin_the_readme_names_loads_offline_with_the_hub_stopped(hub):
    """The README's offline recipe: warm a cache with whole snapshots (a lock's commits through lock.py
    --download, a revision or a version branch through snapshot_download), stop the hub, load with
    HF_HUB_OFFLINE=1 each way the README names."""
    cache = hub.tmp / "offline-cache"
    pinned, moving = hub.commits["first"], hub.commits["second"]
    with running_hub(hub.data, token=TOKEN, trusted_orgs=[ORG]) as endpoint:
        online = client_env(endpoint, cache=cache)
        subprocess.run([sys.executable, str(hub.workspace / "scripts" / "lock.py"), str(hub.lockfile.parent),
                        "--download"], env=online, check=True, capture_output=True)
        warm = f"""
from huggingface_hub import snapshot_download
from kernels.hf_hub import CACHE_DIR
for revision in ("{pinned}", "v1"):
    snapshot_download("{REPO}", repo_type="kernel", revision=revision, cache_dir=CACHE_DIR)
"""
        subprocess.run([sys.executable, "-c", warm], env=online, check=True, capture_output=True)
    offline = {**online, "HF_HUB_OFFLINE": "1"}  # the hub above is stopped: nothing answers at its endpoint
    loads = {
        "load_kernel": (f'kernels.load_kernel("{REPO}", lockfile=Path("{hub.lockfile}"))', pinned),
        "get_locked_kernel": (f'kernels.get_locked_kernel("{REPO}", lockfile=Path("{hub.lockfile}"))', pinned),
        "revision": (f'kernels.get_kernel("{REPO}", revision="{pinned}")', pinned),
        "version": (f'kernels.get_kernel("{REPO}", version=1)', moving),
    }
    for how, (call, commit) in loads.items():
        code = f"""
import json, torch, kernels
from pathlib import Path
k = {call}
y = k.rms_norm(torch.randn(2, 8), torch.ones(8))
print(json.dumps({{"commit": Path(k.__file__).parents[2].name, "finite": bool(torch.isfinite(y).all())}}))
"""
        result = subprocess.run([sys.executable, "-c", code], env=offline, capture_output=True, text=True)
        assert result.returncode == 0, f"{how}: {result.stderr[-2000:]}"
        assert json.loads(result.stdout.strip().splitlines()[-1]) == {"commit": commit, "finite": True}, how


def test_version_bump_publishes_v2_and_v1_v2_load_side_by_side(hub):
    _edit_and_commit(hub.workspace, "rmsnorm/build.toml", "version = 1", "version = 2", "bump to v2")
    hub.publish("rmsnorm")
    refs = hub.refs()
    assert refs["v1"] == hub.commits["second"] and "v2" in refs
    both = hub.client(f"""
        v1 = kernels.get_kernel("{REPO}", version=1)
        v2 = kernels.get_kernel("{REPO}", version=2)
        x, w = torch.randn(2, 8), torch.rand(8)
        same = bool(torch.equal(v1.rms_norm(x, w), v2.rms_norm(x, w)))
        print(json.dumps({{"ids": [v1.__name__, v2.__name__], "same": same}}))
    """)
    assert both["ids"][0] != both["ids"][1] and both["same"]


def test_untrusted_org_needs_trust_remote_code(hub):
    hub.publish("rmsnorm", "--org", "someone-else")
    refused = subprocess.run(
        [sys.executable, "-c", 'import kernels; kernels.get_kernel("someone-else/rmsnorm", version=2)'],
        env=hub.env(), capture_output=True, text=True,
    )
    assert refused.returncode != 0 and "trusted" in refused.stderr
    allowed = hub.client("""
        k = kernels.get_kernel("someone-else/rmsnorm", version=2, trust_remote_code=["someone-else/rmsnorm"])
        print(json.dumps({"ok": bool(torch.isfinite(k.rms_norm(torch.randn(2, 4), None)).all())}))
    """)
    assert allowed["ok"]


def test_racing_publishes_never_corrupt_the_branch(hub):
    """Two publishers with different sources race on one branch: each lands or fails cleanly."""
    other = make_scratch_workspace(hub.tmp / "other-workspace")
    for ws, text in ((hub.workspace, "Racer A. "), (other, "Racer B. ")):
        _edit_and_commit(ws, "rmsnorm/torch-ext/rmsnorm/__init__.py", '"""', '"""' + text, "race")
    results = {}

    def run(ws):
        results[ws] = subprocess.run(
            [sys.executable, str(ws / "scripts" / "publish.py"), "rmsnorm"],
            env=hub.env(), capture_output=True, text=True,
        )

    threads = [threading.Thread(target=run, args=(ws,)) for ws in (hub.workspace, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert any(r.returncode == 0 for r in results.values())
    head = hub.refs()["v2"]
    loaded = hub.load(f'revision="{head}"')
    assert loaded["commit"] == head and loaded["finite"]
    repo_git = next(hub.data.rglob("rmsnorm.git"))
    fsck = subprocess.run(["git", "fsck", "--strict"], cwd=repo_git, capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stderr


def test_restarted_hub_serves_the_same_commits(hub):
    before = hub.refs()
    with running_hub(hub.data, token=TOKEN, trusted_orgs=[ORG]) as endpoint:
        saved, hub.endpoint = hub.endpoint, endpoint
        try:
            assert hub.refs() == before
            assert hub.load(f'revision="{hub.commits["first"]}"')["commit"] == hub.commits["first"]
        finally:
            hub.endpoint = saved
