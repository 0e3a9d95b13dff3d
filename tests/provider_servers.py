"""Loopback servers for the remote-provider tests, each bounded in time and stopped at the end.

FaultServer: a small Starlette app on a free 127.0.0.1 port that plays an OpenAI-compatible
server and its failures, chosen by the model name a request asks for: "echo" streams the last
user message back word by word (honouring n unless told not to), "limited-once" answers 429
with Retry-After first, "limited" always, "broken" 500, "forbidden" 403, "cut" drops the
connection mid-reply, "hang" never answers, "held" streams one word then waits to be released
(recording when the client closes the stream); any other model gets 404. It writes its own SSE
lines because a cut connection is one of the faults (the product's server uses sse-starlette).

The real servers (mlx-lm's own `mlx_lm.server`, and `pagedchat serve`) run as child processes
on the converted default model; their fixtures wait for the "ready" line on an Event-backed
reader, never a sleep, and kill the process at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

MODELS = ["echo", "limited-once", "limited", "broken", "forbidden", "cut", "hang", "held"]
CHILD_TIMEOUT_S = 600  # a real server must be up by then, on this loaded machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chunk(index: int, text: str | None, finish: str | None = None) -> dict:
    delta = {"content": text} if text is not None else {}
    return {"index": index, "delta": delta, "finish_reason": finish}


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class _Server(uvicorn.Server):
    """uvicorn, saying when it listens (or gave up) through an Event."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets=None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.ready.set()


class FaultServer:
    """See the module docstring. `requests` records each request's JSON body."""

    def __init__(self, api_key: str | None = None, honour_n: bool = True) -> None:
        self.api_key = api_key
        self.honour_n = honour_n
        self.requests: list[dict] = []
        self.auth_headers: list[str] = []
        self.release = threading.Event()  # lets "held" finish
        self.held_started = threading.Event()
        self.held_closed = threading.Event()  # the client closed a "held" stream
        self._limited_once_calls = 0
        app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._server = _Server(uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
            ws="none", timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> FaultServer:
        self._thread.start()
        if not self._server.ready.wait(30) or not self._server.started:
            self.__exit__()
            raise RuntimeError("the fault server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self._server.should_exit = True
        self._thread.join(15)

    def _refused(self, request: Request) -> JSONResponse | None:
        header = request.headers.get("authorization", "")
        self.auth_headers.append(header)
        if self.api_key and header != f"Bearer {self.api_key}":
            # like some hosted APIs, it echoes the key it got: the app must scrub it
            given = header.removeprefix("Bearer ")
            return JSONResponse({"error": {"message": f"Incorrect API key provided: {given}.",
                                           "type": "invalid_request_error",
                                           "code": "invalid_api_key"}}, status_code=401)
        return None

    async def models(self, request: Request):
        refused = self._refused(request)
        if refused is not None:
            return refused
        return JSONResponse({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "tests"} for m in MODELS]})

    async def chat(self, request: Request):
        refused = self._refused(request)
        if refused is not None:
            return refused
        body = await request.json()
        self.requests.append(body)
        model = body.get("model")
        if model == "limited-once":
            self._limited_once_calls += 1
            if self._limited_once_calls == 1:
                return self._error(429, "Slow down.", {"Retry-After": "1"})
            model = "echo"
        if model == "limited":
            return self._error(429, "Slow down.", {"Retry-After": "1"})
        if model == "broken":
            return self._error(500, "The model crashed.")
        if model == "forbidden":
            return self._error(403, "This key may not use this model.")
        if model == "hang":
            await asyncio.to_thread(self.release.wait, 60)
            return self._error(500, "released")
        if model not in MODELS:
            return self._error(404, f"The model `{model}` does not exist.")
        words = _words(body)
        n = int(body.get("n") or 1) if self.honour_n else 1
        return StreamingResponse(self._stream(model, words, n, body),
                                 media_type="text/event-stream")

    @staticmethod
    def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "error", "code": status}},
                            status_code=status, headers=headers)

    async def _stream(self, model: str, words: list[str], n: int, body: dict):
        base = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0,
                "model": model}
        try:
            for i, word in enumerate(words):
                if model == "cut" and i == 2:
                    raise ConnectionResetError("the test cuts the stream here")
                choices = [_chunk(k, (word if i == 0 else " " + word) + (f"#{k}" if n > 1
                                                                         else ""))
                           for k in range(n)]
                yield _sse({**base, "choices": choices})
                if model == "held" and i == 0:
                    self.held_started.set()
                    await asyncio.to_thread(self.release.wait, 60)
            yield _sse({**base, "choices": [_chunk(k, None, "stop") for k in range(n)]})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield _sse({**base, "choices": [], "usage": {
                    "prompt_tokens": 7, "completion_tokens": len(words) * n,
                    "total_tokens": 7 + len(words) * n,
                    "prompt_tokens_details": {"cached_tokens": 3}}})
            yield b"data: [DONE]\n\n"
        finally:
            if model == "held":
                self.held_closed.set()


def _words(body: dict) -> list[str]:
    users = [m for m in body.get("messages", []) if m.get("role") == "user"]
    text = users[-1]["content"] if users else "nothing"
    return text.split() or ["(empty)"]


class ChildServer:
    """A real server in a child process, ready when `ready_text` shows in its output."""

    def __init__(self, argv: list[str], ready_text: str, env: dict | None = None) -> None:
        self.argv = argv
        self.ready_text = ready_text
        self.env = env
        self.output: list[str] = []
        self._ready = threading.Event()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ChildServer:
        env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "QT_QPA_PLATFORM")}
        env.update(self.env or {})
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=os.getcwd())
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(CHILD_TIMEOUT_S) or self.proc.poll() is not None:
            self.__exit__()
            raise RuntimeError(f"{self.argv[:3]} did not start:\n{''.join(self.output)[-3000:]}")
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if self.ready_text in line:
                self._ready.set()
        self._ready.set()  # EOF: __enter__ sees the exit code

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def mlx_lm_server(folder: Path, hub_cache: Path) -> tuple[ChildServer, str]:
    """hub_cache: an existing (empty) Hugging Face cache folder; without one its /v1/models
    fails (an empty 200 answer: mlx-lm 0.32.2 scans a cache that is not there)."""
    port = free_port()
    hub_cache.mkdir(parents=True, exist_ok=True)
    child = ChildServer([sys.executable, "-m", "mlx_lm.server", "--model", str(folder),
                         "--host", "127.0.0.1", "--port", str(port), "--max-tokens", "64"],
                        ready_text="Starting httpd", env={"HF_HUB_CACHE": str(hub_cache)})
    return child, f"http://127.0.0.1:{port}/v1"


def pagedchat_serve(api_key: str) -> tuple[ChildServer, str]:
    port = free_port()
    child = ChildServer([sys.executable, "-m", "app.main", "serve", "--port", str(port),
                         "--kv-memory-mib", "32"], ready_text=f"127.0.0.1:{port}",
                        env={"PAGEDCHAT_API_KEY": api_key})
    return child, f"http://127.0.0.1:{port}/v1"

