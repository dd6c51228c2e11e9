"""Committed git copies of the workspace for tests that edit sources, commit or publish; the commit helper."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_scratch_workspace(dest: Path) -> Path:
    """A committed git copy of this workspace (tracked and untracked-not-ignored files) at `dest`.

    Tests that edit sources, commit, or publish work on such a copy, never on the checkout itself.
    """
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    git_commit(dest, "scratch copy", init=True)
    return dest


def git_commit(repo: Path, message: str, *, init: bool = False) -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout

    if init:
        git("init", "-q", "-b", "main")
    git("add", "-A")
    git("-c", "user.name=test", "-c", "user.email=test@example.com", "commit", "-q", "--allow-empty", "-m", message)
    return git("rev-parse", "HEAD").strip()
