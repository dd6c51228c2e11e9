"""Errors answered the Hub's way. Storage, commit parsing and the API raise them; the HTTP layer
(`api.error_reply`) turns one into the status, `X-Error-Code`, `X-Error-Message` and JSON body the
clients read."""

from __future__ import annotations


class HubError(Exception):
    """A failed request: HTTP status, the Hub's error code, a message, extra headers and body fields."""

    def __init__(self, status: int, code: str, message: str, *, headers: dict | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}
        self.extra = extra or {}


def bad_request(message: str) -> HubError:
    return HubError(400, "BadRequest", message)


def repo_not_found(repo_id: str) -> HubError:
    return HubError(404, "RepoNotFound", f"Repository {repo_id} not found")


def revision_not_found(revision: str) -> HubError:
    return HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")


def entry_not_found(message: str, commit: str) -> HubError:
    # The client caches a `.no_exist` marker for the commit named in X-Repo-Commit.
    return HubError(404, "EntryNotFound", message, headers={"X-Repo-Commit": commit})
