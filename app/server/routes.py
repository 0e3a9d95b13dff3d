"""The Starlette app: OpenAI's endpoints over one running Engine, with auth and limits.

Each API request becomes one engine request in a session of its own ("API", or "API · user"
with the client's ``user`` field), so the KV monitor shows it like a chat and its prompt
shares prefix blocks with any chat that starts the same way. The app never blocks its loop:
submitting is non-blocking, events arrive through ``RequestHandle.stream()``, and
tokenisation runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.core.model_names import model_id
from app.server.answer import body_of, check_first, check_model, collect, submit_parsed
from app.server.batches import DEFAULT_MAX_FILE_BYTES, BatchManager, batch_routes
from app.server.errors import APIError
from app.server.keys import bearer_matches
from app.server.params import ParsedRequest, parse_chat, parse_completion
from app.server.streaming import Reply, sse_events
from engine import Engine, Priority, RequestHandle

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_MAX_CONCURRENT = 16
SHUTDOWN_GRACE_S = 10.0
SESSION_PREFIX = "API"
MAX_USER_CHARS = 40


# An over-long body is read this far (and dropped) so the client can read its 413.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024



@dataclass
class ServerOptions:
    """api_key: the bearer key every /v1 request must carry (compared in constant time).
    max_request_bytes: larger bodies get 413. max_concurrent: requests in flight beyond it
    get 429 (batch jobs have their own limit). model_aliases: other names accepted in a
    request's ``model`` field."""

    api_key: str
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    model_aliases: tuple[str, ...] = ("default",)
    #: where /v1/files and /v1/batches keep their files; None: a temporary folder, gone
    #: with the process
    files_dir: Path | None = None
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES


@dataclass
class _State:
    options: ServerOptions
    engine: Callable[[], Engine | None]
    in_flight: int = 0
    handles: set[RequestHandle] = field(default_factory=set)
    batches: BatchManager | None = None


def session_for(user: str | None) -> str:
    """The engine session of an API request: one per client ``user``, else plain "API"."""
    if not user:
        return SESSION_PREFIX
    return f"{SESSION_PREFIX} · {user.strip()[:MAX_USER_CHARS]}"


def create_app(engine: Engine | Callable[[], Engine | None], options: ServerOptions) -> Starlette:
    """The ASGI app. ``engine`` may be a callable so the app follows an engine that the
    desktop app restarts (a model change) without restarting the server."""
    provider = engine if callable(engine) and not isinstance(engine, Engine) else (
        lambda: engine
    )
    state = _State(options, provider)

    async def handle_errors(request: Request, exc: Exception) -> Response:
        if isinstance(exc, APIError):
            return exc.response()
        if isinstance(exc, HTTPException):
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return APIError(exc.status_code, f"{request.method} {request.url.path}: "
                            f"{exc.detail}", code=code).response()
        raise exc

    async def models(request: Request) -> Response:
        _authorise(state, request)
        engine = _ready_engine(state)
        return JSONResponse({"object": "list", "data": [{
            "id": model_id(engine.model_info.name), "object": "model", "created": 0,
            "owned_by": "pagedchat",
        }]})

    async def health(request: Request) -> Response:
        engine = state.engine()
        status = engine.status if engine is not None else "stopped"
        body = {"status": "ok" if status == "ready" else status}
        if engine is not None and engine.model_info is not None:
            body["model"] = model_id(engine.model_info.name)
        return JSONResponse(body, status_code=200 if status == "ready" else 503)

    async def chat(request: Request) -> Response:
        return await _generate(state, request, chat=True)

    async def completions(request: Request) -> Response:
        return await _generate(state, request, chat=False)

    files_dir = options.files_dir or Path(tempfile.mkdtemp(prefix="pagedchat-files-"))
    state.batches = BatchManager(files_dir, provider, options.model_aliases)
    app = Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            *batch_routes(state.batches, lambda request: _authorise(state, request),
                          options.max_file_bytes, lambda request: _read_json(state, request)),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={APIError: handle_errors, HTTPException: handle_errors},
    )
    app.state.pagedchat = state
    return app


def started(app: Starlette) -> None:
    """The server listens (on its loop): go on with the batches a previous run left."""
    app.state.pagedchat.batches.resume_unfinished()


def cancel_all(app: Starlette) -> None:
    """Cancel every request in flight (shutdown): each stream then ends with a final chunk.
    Batch jobs stop too, their batches left in progress for the next start to finish."""
    for handle in list(app.state.pagedchat.handles):
        handle.cancel()
    app.state.pagedchat.batches.stop_jobs()


def _authorise(state: _State, request: Request) -> None:
    header = request.headers.get("authorization")
    if not bearer_matches(header, state.options.api_key):
        raise APIError(
            401,
            "missing API key: send 'Authorization: Bearer KEY'" if not header
            else "the API key is not valid for this server",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _ready_engine(state: _State) -> Engine:
    engine = state.engine()
    if engine is None or engine.status != "ready":
        status = engine.status if engine is not None else "stopped"
        why = {"loading": "the model is still loading: retry shortly"}.get(
            status, f"the engine is not serving ({status}"
            + (f": {engine.load_error})" if engine is not None and engine.load_error else ")")
        )
        raise APIError(503, why, code="engine_unavailable", headers={"Retry-After": "5"})
    return engine


async def _read_json(state: _State, request: Request) -> object:
    limit = state.options.max_request_bytes
    too_large = APIError(413, f"the request body is larger than {limit} bytes",
                         code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        await _drain(request)
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            await _drain(request)
            raise too_large
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}",
                       code="invalid_json") from exc


async def _drain(request: Request) -> None:
    """Read (and drop) the rest of an over-long body, up to DRAIN_LIMIT_BYTES, before the 413.

    Answering while the client is still sending makes the server close the connection under
    it: the client then sees a broken pipe instead of the 413 that says what is wrong."""
    drained = 0
    async for chunk in request.stream():
        drained += len(chunk)
        if drained > DRAIN_LIMIT_BYTES:
            return


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _or_disconnect(request: Request, awaitable) -> tuple[bool, object]:
    """Await ``awaitable`` unless the client leaves first: (finished, result)."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work.done():
        return True, work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
        await work
    return False, None


async def _generate(state: _State, request: Request, chat: bool) -> Response:
    _authorise(state, request)
    body = await _read_json(state, request)
    parsed = parse_chat(body) if chat else parse_completion(body)
    engine = _ready_engine(state)
    check_model(engine, state.options.model_aliases, parsed.model)
    if state.in_flight >= state.options.max_concurrent:
        raise APIError(429, f"the server is busy: {state.in_flight} requests in flight (the "
                       f"limit is {state.options.max_concurrent}); retry shortly",
                       code="too_many_requests", headers={"Retry-After": "1"})
    state.in_flight += 1
    streaming = False
    try:
        response = await _submit_and_answer(state, request, engine, parsed, chat)
        streaming = isinstance(response, EventSourceResponse)
        return response
    finally:
        if not streaming:
            state.in_flight -= 1


async def _submit_and_answer(state: _State, request: Request, engine: Engine,
                             parsed: ParsedRequest, chat: bool) -> Response:
    # API requests are background work: the chats in front of the user go first.
    submitted = await submit_parsed(engine, parsed, chat, session_for(parsed.user),
                                    priority=Priority.BACKGROUND)
    handle, reply, param = submitted.handle, submitted.reply, submitted.param
    state.handles.add(handle)
    events = handle.stream()
    handed_over = False
    try:
        finished, first = await _or_disconnect(request, events.__anext__())
        if not finished:
            handle.cancel()
            return Response(status_code=499)
        check_first(first, param)
        if parsed.stream:
            handed_over = True
            finish = _finisher(state, handle)
            return EventSourceResponse(
                _stream(finish, reply, first, events),
                background=BackgroundTask(finish),
                ping=0,
                sep="\n",
                shutdown_event=_anyio_event(),
                shutdown_grace_period=SHUTDOWN_GRACE_S,
            )
        finished, _ = await _or_disconnect(request, collect(reply, first, events))
        if not finished:
            handle.cancel()
            return Response(status_code=499)
        return JSONResponse(body_of(reply))
    finally:
        if not handed_over:
            state.handles.discard(handle)
            await events.aclose()


async def _stream(finish, reply: Reply, first, events):
    """The SSE payloads; leaving early (a client gone, a shutdown) cancels the request."""
    try:
        async for payload in sse_events(reply, first, events):
            yield payload
    finally:
        await finish()
        await events.aclose()


def _finisher(state: _State, handle: RequestHandle):
    """The end of a stream, run once: by the generator, or by the response's background
    task when the client left before the generator ever started."""
    finished = False

    async def finish() -> None:
        nonlocal finished
        if finished:
            return
        finished = True
        if not handle.done:
            handle.cancel()  # the engine frees its blocks before its next step
        state.handles.discard(handle)
        state.in_flight -= 1

    return finish


def _anyio_event():
    import anyio

    return anyio.Event()
