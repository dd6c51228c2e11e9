"""The main job, end to end on this machine: start the self-hosted hub, publish v1 of every kernel
to it, then load each kernel with `get_kernel("<org>/<name>", version=1)` in a fresh process and run
it on sample data. The hub keeps its data in .hub-data/ inside the checkout and is stopped at the end.
"""

import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hubtools.client_env import client_env  # noqa: E402
from hubtools.hub.server import running_hub  # noqa: E402
from hubtools.workspace import Workspace  # noqa: E402


def main() -> int:
    workspace = Workspace.load()
    token = secrets.token_hex(16)
    with running_hub(ROOT / ".hub-data", token=token, trusted_orgs=[workspace.org]) as endpoint, \
            tempfile.TemporaryDirectory() as cache:
        env = client_env(endpoint, token=token, cache=Path(cache))
        print(f"hub: {endpoint} (data in {ROOT / '.hub-data'})\n")
        # --allow-dirty so the demo also runs on a working copy with local edits (it says so loudly).
        subprocess.run([sys.executable, str(ROOT / "scripts" / "publish.py"), "--allow-dirty"], env=env, check=True)
        print()
        for project in workspace.kernels():
            subprocess.run(
                [sys.executable, str(ROOT / "examples" / "consume.py"), project.repo_id, project.smoke],
                env=env, check=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
