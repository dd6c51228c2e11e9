"""Environment for client processes (HfApi, kernels) that talk to a given hub."""

from __future__ import annotations

import os
from pathlib import Path


def client_env(endpoint: str, *, token: str | None = None, cache: Path | None = None) -> dict[str, str]:
    """os.environ plus HF_ENDPOINT (and token, caches) for a fresh client process.

    The endpoint must be set before huggingface_hub is imported (it is frozen at import), which is
    why clients run in their own processes. kernels 0.17.2 with huggingface_hub 2.x builds an invalid
    User-Agent (trailing "; ") when HF_HUB_DISABLE_TELEMETRY is set; naming an origin avoids it.
    """
    env = {**os.environ, "HF_ENDPOINT": endpoint}
    if token:
        env["HF_TOKEN"] = token
    if cache:
        env["HF_HOME"] = str(cache)
        env["KERNELS_CACHE"] = str(cache / "kernels")
    if env.get("HF_HUB_DISABLE_TELEMETRY"):
        env.setdefault("HF_HUB_USER_AGENT_ORIGIN", "triton-llm-kernels")
    return env
