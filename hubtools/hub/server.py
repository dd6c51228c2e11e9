"""The hub as a process: the HTTP server over `api.KernelHub`, its command line (`python scripts/hub.py --data
DIR`), and `running_hub(data_dir)`, which tests and tooling use to run one on a free loopback port."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator
from urllib.parse import parse_qsl, unquote, urlsplit

from .api import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_FILES, KernelHub, Reply, Request, error_reply
from .errors import HubError
from .storage import check_repo_part

REPO_ROOT = Path(__file__).resolve().parents[2]


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
            reply = error_reply(err)
        except Exception:
            self.log_error("internal error on %s %s\n%s", self.command, self.path, traceback.format_exc())
            self.close_connection = True  # the request may not have been read in full
            reply = error_reply(HubError(500, "InternalError", "Internal error in the kernel hub; see its log"))
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

    def handle_error(self, request, client_address) -> None:
        # A client closing its keep-alive connection while the handler waits for the next request line is not a
        # server error (socketserver would print its traceback); anything else still is.
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


# --------------------------------------------------------------------------------------------------- command line


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
    print(f"kernel hub: serving {hub.store.data_dir} at http://{host}:{port}", flush=True)
    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a foreground hub is stopped
            server.serve_forever()
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
            with contextlib.suppress(OSError):  # not accepting connections yet: asked again until the deadline
                connection.request("GET", "/api/organizations/probe/overview")
                if connection.getresponse().status == 200:
                    return endpoint
        finally:
            connection.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the kernel hub at {endpoint} does not answer")
        time.sleep(0.05)
