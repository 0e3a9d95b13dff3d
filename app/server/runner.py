"""Running the app under uvicorn: in the foreground (``pagedchat serve``) or in a thread of
its own with its own asyncio loop (the desktop app, tests).

Stopping first cancels every request in flight, so each open stream ends with a final chunk
and ``[DONE]`` instead of a cut connection; only then does uvicorn close the connections.
The listening socket is bound here, before uvicorn starts, so a busy port fails at once with
a clear message and port 0 (tests) gives a free port whose number is known.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable

import uvicorn
from starlette.applications import Starlette

from app.server.routes import SHUTDOWN_GRACE_S, cancel_all, started

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class BindError(OSError):
    """The address could not be bound; the message says what to change."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                        "(choose another --port, or stop what uses it)") from exc
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


class _Server(uvicorn.Server):
    """uvicorn's server, telling us when it listens and cancelling requests on exit."""

    def __init__(self, config: uvicorn.Config, app: Starlette,
                 on_started: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._app = app
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            started(self._app)
        if self.started and self._on_started is not None:
            self._on_started()

    def handle_exit(self, sig, frame) -> None:  # Ctrl+C / SIGTERM in the foreground
        cancel_all(self._app)
        super().handle_exit(sig, frame)


def _config(app: Starlette, log_level: str, access_log: bool,
            own_logging: bool = False) -> uvicorn.Config:
    """own_logging: let uvicorn set up its console logging (the foreground server only;
    inside the app or a test it would replace their logging setup)."""
    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        log_config=uvicorn.config.LOGGING_CONFIG if own_logging else None,
        lifespan="off",
        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S) + 5,
        ws="none",
    )


def serve_forever(app: Starlette, sock: socket.socket, on_started: Callable[[], None],
                  log_level: str = "info") -> None:
    """Serve in this (main) thread until Ctrl+C / SIGTERM; uvicorn installs the handlers."""
    server = _Server(_config(app, log_level, access_log=True, own_logging=True), app,
                     on_started)
    server.run(sockets=[sock])


class ServerThread:
    """uvicorn in a thread of its own (its own asyncio loop), for the desktop app and tests.

    ``start()`` returns once it listens (or raises); ``stop()`` ends every open stream with a
    final chunk, then closes the connections and joins the thread.
    """

    def __init__(self, app: Starlette, host: str = LOOPBACK, port: int = 0,
                 log_level: str = "warning") -> None:
        self.app = app
        self.host = host
        self.port = port
        self._log_level = log_level
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.url = ""

    def start(self, timeout: float = 30.0) -> str:
        """Bind and serve; returns the base URL (``http://host:port/v1``)."""
        if self._thread is not None:
            raise RuntimeError("the server is already running")
        sock = bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        self.url = url_of(sock)
        self._server = _Server(_config(self.app, self._log_level, access_log=False), self.app,
                               self._started.set)
        self._thread = threading.Thread(target=self._run, args=(sock,),
                                        name="pagedchat-api-server", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            self.stop()
            raise RuntimeError(self._error and str(self._error) or "the server did not start")
        return self.url

    def _run(self, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._server.serve(sockets=[sock]))
        except BaseException as exc:  # reported by start(); the app keeps running
            self._error = exc
            log.exception("the API server stopped with an error")
        finally:
            sock.close()
            loop.close()
            self._started.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = SHUTDOWN_GRACE_S + 10) -> None:
        if self._thread is None:
            return
        loop, server = self._loop, self._server
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(cancel_all, self.app)
        if server is not None:
            server.should_exit = True
        self._thread.join(timeout)
        self._thread = None
        self._started.clear()
