"""``pagedchat serve``: the OpenAI-compatible server alone, with no window and no Qt at all.

It binds before loading the model (a busy port fails in a second, not after the load),
prints the URL once uvicorn listens, and on Ctrl+C / SIGTERM ends every open stream with a
final chunk before it stops the engine.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from app.server.batches import default_files_dir
from app.server.engine_args import add_engine_args, engine_config
from app.server.keys import ENV_VAR, KeyUnavailable, resolve_key
from app.server.routes import (
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_REQUEST_BYTES,
    ServerOptions,
    create_app,
)
from app.server.runner import LOOPBACK, BindError, bind, is_loopback, serve_forever, url_of

DEFAULT_PORT = 8080


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedchat serve",
        description="Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, "
        "/v1/files, /v1/batches) "
        "from PagedChat's paged engine, without a window.",
    )
    p.add_argument("--host", default=LOOPBACK,
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default 8080)")
    p.add_argument("--allow-remote", action="store_true",
                   help="needed to listen on an address other than loopback")
    add_engine_args(p)
    p.add_argument("--api-key", metavar="KEY",
                   help=f"the bearer key clients must send (else ${ENV_VAR}, else the key kept "
                   "in the OS keychain, generated on first run)")
    p.add_argument("--show-key", action="store_true",
                   help="print the key the server would require, and exit")
    p.add_argument("--max-concurrent", type=int, default=DEFAULT_MAX_CONCURRENT,
                   help=f"requests in flight before answering 429 (default "
                   f"{DEFAULT_MAX_CONCURRENT})")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body before answering 413 (default "
                   f"{DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--files-dir", metavar="DIR", type=Path, default=None,
                   help="where /v1/files and /v1/batches keep uploads, outputs and batches "
                   f"(default {default_files_dir()})")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    return p


def _say(text: str, err: bool = False) -> None:
    print(text, file=sys.stderr if err else sys.stdout, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        key, source = resolve_key(args.api_key)
    except KeyUnavailable as exc:
        _say(f"pagedchat serve: {exc}", err=True)
        return 2
    if args.show_key:
        _say(key)
        return 0
    if not is_loopback(args.host):
        if not args.allow_remote:
            _say(f"pagedchat serve: {args.host} is reachable from other machines; pass "
                 "--allow-remote as well if that is what you want", err=True)
            return 2
        _say(f"WARNING: listening on {args.host}: other machines can reach this server "
             "(every request still needs the API key)", err=True)
    if args.max_concurrent < 1 or args.max_request_bytes < 1024:
        _say("pagedchat serve: --max-concurrent must be >= 1 and --max-request-bytes >= 1024",
             err=True)
        return 2

    from app.core import openblas
    from app.core.model_names import model_id
    from engine import Engine

    blas = openblas.state()  # loaded by app.main before MLX; says so when it could not

    try:
        config = engine_config(args)
    except ValueError as exc:
        _say(f"pagedchat serve: {exc}", err=True)
        return 2
    files_dir = args.files_dir or default_files_dir()
    try:
        files_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _say(f"pagedchat serve: the files folder {files_dir} cannot be created: "
             f"{exc.strerror or exc} (choose another with --files-dir)", err=True)
        return 2
    try:
        sock = bind(args.host, args.port)
    except BindError as exc:
        _say(f"pagedchat serve: {exc}", err=True)
        return 1

    engine = Engine(config)
    # SIGTERM acts like Ctrl+C throughout: uvicorn re-raises the signal it caught once it
    # has shut down, and this way that ends in the KeyboardInterrupt below (engine stopped,
    # exit 0) instead of killing the process before the engine thread is stopped.
    previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        _say(f"Loading {args.model} ...")
        engine.start()
        if not engine.wait_ready():
            _say(f"pagedchat serve: the model did not load: {engine.load_error}", err=True)
            return 1
        app = create_app(engine, ServerOptions(
            api_key=key, max_request_bytes=args.max_request_bytes,
            max_concurrent=args.max_concurrent, model_aliases=("default", args.model),
            files_dir=files_dir))
        url = url_of(sock)
        where = {"keychain": "the OS keychain (print it with `pagedchat serve --show-key`)"}

        def started() -> None:
            _say(f"PagedChat API serving {model_id(engine.model_info.name)} at {url}")
            if blas.problem:
                _say(f"WARNING: {blas.problem}", err=True)
            _say(f"API key: from {where.get(source, source)}; press Ctrl+C to stop")

        serve_forever(app, sock, started, log_level=args.log_level)
    except KeyboardInterrupt:  # Ctrl+C / SIGTERM: while loading, or re-raised by uvicorn
        pass
    finally:
        sock.close()
        engine.stop()
        signal.signal(signal.SIGTERM, previous_term)
    _say("PagedChat API server stopped")
    return 0
