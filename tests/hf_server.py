"""A loopback Hugging Face Hub for the download tests: the few endpoints huggingface_hub
calls, served from folders the test makes, with the failures the tests need.

Endpoints (as huggingface_hub 2.x asks for them, see ``HfApi.model_info`` and
``file_download.get_hf_file_metadata`` / ``http_get``):

* ``GET /api/models/{repo}[/revision/{rev}]``: the repo's commit sha and its files with
  sizes (``siblings``); ``X-Error-Code: RepoNotFound`` with 404 for a repo it does not have;
* ``HEAD /{repo}/resolve/{rev}/{file}``: ETag, ``X-Repo-Commit`` and Content-Length;
  ``X-Error-Code: GatedRepo`` with 401 for a gated repo without the right Bearer token;
* ``GET`` of the same with an optional ``Range: bytes=N-`` (206 and Content-Range).

Faults: ``drop_once[file] = n`` sends the first n bytes of the next GET of ``file`` and
closes the connection; ``fail[file] = status`` answers every GET of it with that status;
``hold[file] = Event()`` sends half of the next GET of ``file`` and the rest once the Event
is set (a download the test can cancel while it is surely in flight).
Every request is logged (method, path, Range), so a test can prove which bytes were fetched.
The server binds 127.0.0.1 on a free port and shuts itself down after ``LIFETIME_S``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LIFETIME_S = 300.0
GOOD_TOKEN = "hf_test_token_with_access"


@dataclass
class Logged:
    method: str
    path: str
    range: str | None
    sent: int = 0  # body bytes sent


@dataclass
class HubState:
    repos: dict[str, Path] = field(default_factory=dict)
    gated: set[str] = field(default_factory=set)
    drop_once: dict[str, int] = field(default_factory=dict)
    fail: dict[str, int] = field(default_factory=dict)
    hold: dict[str, threading.Event] = field(default_factory=dict)
    log: list[Logged] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def gets(self, file: str) -> list[Logged]:
        with self.lock:
            return [r for r in self.log if r.method == "GET" and r.path.endswith("/" + file)]


def _files(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}


def _etag(path: Path) -> str:
    return '"' + hashlib.sha256(path.read_bytes()).hexdigest() + '"'


class _Handler(BaseHTTPRequestHandler):
    state: HubState  # set on the class made per server
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        return None

    def _error(self, status: int, code: str | None = None, message: str = "") -> None:
        body = json.dumps({"error": message or code or "error"}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _record(self) -> Logged:
        entry = Logged(self.command, unquote(urlparse(self.path).path), self.headers.get("Range"))
        with self.state.lock:
            self.state.log.append(entry)
        return entry

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _serve(self, head: bool) -> None:
        entry = self._record()
        path = entry.path
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        if api:
            return self._model_info(api.group(1))
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+/?", path)
        if tree:  # HfApi.list_repo_tree, which snapshot_download calls
            return self._tree(tree.group(1))
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not resolve:
            return self._error(404, "EntryNotFound")
        repo, _rev, name = resolve.groups()
        folder = self.state.repos.get(repo)
        if folder is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if repo in self.state.gated and self.headers.get("Authorization") != \
                f"Bearer {GOOD_TOKEN}":
            return self._error(401, "GatedRepo", "Access to this model is restricted")
        file = _files(folder).get(name)
        if file is None:
            return self._error(404, "EntryNotFound")
        if not head and name in self.state.fail:
            return self._error(self.state.fail[name], None, "internal error")
        self._send_file(file, name, head, entry)

    def _model_info(self, repo: str) -> None:
        folder = self.state.repos.get(repo)
        if folder is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        body = json.dumps({
            "id": repo, "modelId": repo, "sha": COMMIT, "private": False,
            "gated": "manual" if repo in self.state.gated else False,
            "siblings": [{"rfilename": n, "size": p.stat().st_size}
                         for n, p in _files(folder).items()],
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _tree(self, repo: str) -> None:
        folder = self.state.repos.get(repo)
        if folder is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        body = json.dumps([
            {"type": "file", "path": n, "size": p.stat().st_size,
             "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
            for n, p in _files(folder).items()]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_file(self, file: Path, name: str, head: bool, entry: Logged) -> None:
        data = file.read_bytes()
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if match:
            start = int(match.group(1))
        body = data[start:]
        self.send_response(206 if match else 200)
        self.send_header("ETag", _etag(file))
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(body)))
        if match:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        hold = self.state.hold.get(name)
        if hold is not None:  # half now, the rest once the test releases it
            half = len(body) // 2
            self.wfile.write(body[:half])
            self.wfile.flush()
            entry.sent = half
            if not hold.wait(60):
                return
            del self.state.hold[name]
            try:
                self.wfile.write(body[half:])
            except ConnectionError:
                return
            entry.sent = len(body)
            return
        cut = self.state.drop_once.pop(name, None)
        if cut is not None:
            self.wfile.write(body[:cut])
            entry.sent = cut
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # mid-body: the client sees the stream end early
            return
        self.wfile.write(body)
        entry.sent = len(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):  # a cancel hangs up on us
            super().handle_error(request, client_address)


class LoopbackHub:
    """The server; ``url`` is what HF_ENDPOINT points at."""

    def __init__(self) -> None:
        self.state = HubState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.httpd = _Server(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._timer = threading.Timer(LIFETIME_S, self.stop)  # stops itself, whatever happens
        self._timer.daemon = True

    def __enter__(self) -> LoopbackHub:
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()

    def add(self, repo_id: str, folder: Path, gated: bool = False) -> None:
        self.state.repos[repo_id] = folder
        if gated:
            self.state.gated.add(repo_id)


def free_port() -> int:
    """A port nobody listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
