"""Batch jobs: OpenAI's batch input format in, its batch output format out, through the pool.

Qt-free, used by ``pagedchat batch`` (batch_cli.py), the server's /v1/batches (batches.py)
and the app's File > Run Batch… (app/window/batch_panel.py). docs/ARCHITECTURE.md §7.

* ``read_input`` validates every line before anything runs: each problem is a ``LineError``
  with its 1-based line number (a JSON error, a missing custom_id, a duplicate, an endpoint
  this server has not, a body the endpoint would answer with a 400).
* ``BatchJob`` runs the good lines at background priority with bounded concurrency, each
  through the endpoints' own code path (answer.py), so a line's response body is what the
  endpoint would answer. Every finished line is appended to the output file at once (one
  write, fsync), so an interruption (even kill -9) loses at most the lines in flight.
* A rerun reads the output file first (``OutputFile.load``): lines already there are not
  computed again (``BatchJob.computed`` counts those that are), a line cut short by a kill
  is dropped, and an output that belongs to another input is refused, never overwritten.
  When every line is done the output is rewritten in input order (a temporary file, then an
  atomic rename).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from app.server.answer import answer, check_model, submit_parsed
from app.server.errors import APIError
from app.server.params import ParsedRequest, parse_chat, parse_completion
from engine import Engine, Priority

#: the endpoints a batch line may call, and whether each is chat
ENDPOINTS = {"/v1/chat/completions": True, "/v1/completions": False}
#: how often a job looks again for an engine that is not serving (a model loading)
ENGINE_WAIT_S = 0.5
MAX_CUSTOM_ID_CHARS = 512


class BatchInputError(Exception):
    """The input or output file cannot be used at all; the message says why."""


@dataclass
class LineError(Exception):
    """What is wrong with one input line (``number`` counts from 1)."""

    number: int
    message: str
    custom_id: str | None = None

    def __str__(self) -> str:
        return f"line {self.number}: {self.message}"


@dataclass(frozen=True)
class BatchLine:
    number: int
    custom_id: str
    url: str
    parsed: ParsedRequest

    @property
    def chat(self) -> bool:
        return ENDPOINTS[self.url]


def parse_line(number: int, text: str, endpoint: str | None = None) -> BatchLine:
    """One input line, validated; a LineError (raised) says what is wrong with it."""
    try:
        item = json.loads(text)
    except ValueError as exc:
        raise LineError(number, f"not valid JSON: {exc}") from None
    if not isinstance(item, dict):
        raise LineError(number, "must be a JSON object with custom_id, method, url and body")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id.strip():
        raise LineError(number, "custom_id must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineError(number, f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters",
                        custom_id)
    method = item.get("method")
    if method != "POST":
        raise LineError(number, f"method must be \"POST\", got {method!r}", custom_id)
    url = item.get("url")
    if url not in ENDPOINTS:
        raise LineError(number, f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}",
                        custom_id)
    if endpoint is not None and url != endpoint:
        raise LineError(number, f"url is {url} but this batch's endpoint is {endpoint}",
                        custom_id)
    body = item.get("body")
    if not isinstance(body, dict):
        raise LineError(number, "body must be a JSON object (the request's body)", custom_id)
    if body.get("stream"):
        raise LineError(number, "body.stream: a batch line cannot stream; leave it out",
                        custom_id)
    try:
        parsed = parse_chat(body) if ENDPOINTS[url] else parse_completion(body)
    except APIError as exc:
        where = f"body.{exc.param}: " if exc.param else "body: "
        raise LineError(number, where + exc.message, custom_id) from None
    return BatchLine(number, custom_id, url, parsed)


def parse_lines(lines: Iterable[str], endpoint: str | None = None
                ) -> tuple[list[BatchLine], list[LineError]]:
    """Every line validated: (the good ones, a LineError per bad one). Empty lines are
    skipped; a custom_id used again is an error on the later line."""
    good: list[BatchLine] = []
    bad: list[LineError] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            line = parse_line(number, text, endpoint)
        except LineError as error:
            bad.append(error)
            continue
        first = seen.setdefault(line.custom_id, number)
        if first != number:
            bad.append(LineError(number, f"custom_id {line.custom_id!r} is used again (first on "
                                 f"line {first}): each line needs its own", line.custom_id))
            continue
        good.append(line)
    return good, bad


def read_input(path: str | os.PathLike, endpoint: str | None = None
               ) -> tuple[list[BatchLine], list[LineError]]:
    """The lines of a batch input file (JSONL, UTF-8), validated."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise BatchInputError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise BatchInputError(f"{path} is a folder, not a JSONL file") from None
    except UnicodeDecodeError as exc:
        raise BatchInputError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") \
            from None
    except OSError as exc:
        raise BatchInputError(f"{path} cannot be read: {exc.strerror or exc}") from None
    good, bad = parse_lines(text.splitlines(), endpoint)
    if not good and not bad:
        raise BatchInputError(f"{path} holds no requests (one JSON object per line)")
    return good, bad


def check_models(lines: list[BatchLine], engine: Engine, aliases: tuple[str, ...]
                 ) -> tuple[list[BatchLine], list[LineError]]:
    """The lines whose ``model`` the engine serves, and a LineError for each other one."""
    good, bad = [], []
    for line in lines:
        try:
            check_model(engine, aliases, line.parsed.model)
        except APIError as exc:
            bad.append(LineError(line.number, f"body.model: {exc.message}", line.custom_id))
            continue
        good.append(line)
    return good, bad


# ---- output -------------------------------------------------------------------------------


def success_record(custom_id: str, body: dict) -> dict:
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
            "error": None}


def failure_record(custom_id: str, error: APIError) -> dict:
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id,
            "response": {"status_code": error.status, "request_id": uuid.uuid4().hex,
                         "body": error.body()},
            "error": None}


def succeeded(record: dict) -> bool:
    return (record.get("response") or {}).get("status_code") == 200


class OutputFile:
    """The output JSONL, appended one finished line at a time and read back on a rerun."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def load(self, custom_ids: set[str] | None = None) -> dict[str, dict]:
        """The records already written, by custom_id. A last line cut short (the process
        was killed while writing it) is cut off the file; anything else that is not a
        record of this batch (``custom_ids``) raises BatchInputError: the file is not
        this batch's output, and is left as it is."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except IsADirectoryError:
            raise BatchInputError(f"{self.path} is a folder: give a file for the output") \
                from None
        except OSError as exc:
            raise BatchInputError(f"{self.path} cannot be read: {exc.strerror or exc}") \
                from None
        done: dict[str, dict] = {}
        lines = data.split(b"\n")
        complete = len(data) - len(lines[-1])  # bytes up to the last newline
        if lines[-1].strip():  # a line cut short: the kill came while it was being written
            with open(self.path, "r+b") as f:
                f.truncate(complete)
                f.flush()
                os.fsync(f.fileno())
        for number, raw in enumerate(lines[:-1], start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
                custom_id = record["custom_id"]
                record["response"]  # noqa: B018 (a record has one)
            except (ValueError, KeyError, TypeError):
                raise BatchInputError(
                    f"{self.path} line {number} is not a batch output line: it is not this "
                    "batch's output; choose another output file (nothing was changed)"
                ) from None
            if custom_ids is not None and custom_id not in custom_ids:
                raise BatchInputError(
                    f"{self.path} holds a result for custom_id {custom_id!r}, which this input "
                    "has not: it is another batch's output; choose another output file "
                    "(nothing was changed)")
            done[custom_id] = record
        return done

    def append(self, record: dict) -> None:
        """One record as one line, on disk before this returns."""
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

    def rewrite(self, records: list[dict]) -> None:
        """The whole file replaced by ``records`` (in this order), atomically."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with self._lock:
            with open(tmp, "wb") as f:
                for record in records:
                    f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)


# ---- running ------------------------------------------------------------------------------


@dataclass
class Progress:
    total: int
    done: int = 0  # lines with a result (resumed ones included)
    failed: int = 0  # of those, the ones whose result is an error
    resumed: int = 0  # results found in the output file when the job started
    tokens: int = 0  # completion tokens generated by this run
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    @property
    def elapsed(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at this run's pace so far; None before the first line of this run."""
        computed = self.done - self.resumed
        if computed <= 0:
            return None
        return self.elapsed / computed * (self.total - self.done)

    def describe(self) -> str:
        eta = self.eta_s
        left = "" if eta is None else f", {_duration(eta)} left"
        failed = f" ({self.failed} failed)" if self.failed else ""
        return (f"{self.done}/{self.total} done{failed}, {self.tokens_per_s:.1f} tok/s{left}")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class BatchJob:
    """Runs ``lines`` into ``output``; ``run()`` on any asyncio loop (the CLI's, the server's
    or the app's qasync loop): it never blocks the loop (file writes go to a worker thread).

    ``engine``: the Engine, or a callable giving the one serving now (None or not ready: the
    job waits for it). ``concurrency``: requests handed to the engine at once.
    ``on_progress(progress)`` is called on the loop after each line."""

    def __init__(self, lines: list[BatchLine], output: OutputFile,
                 engine: Engine | Callable[[], Engine | None], session_id: str,
                 concurrency: int = 16,
                 on_progress: Callable[[Progress], None] | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.lines = lines
        self.output = output
        self._engine = engine if callable(engine) and not isinstance(engine, Engine) else (
            lambda: engine)
        self.session_id = session_id
        self.concurrency = concurrency
        self.on_progress = on_progress
        self.progress = Progress(total=len(lines))
        self.computed = 0  # lines this run handed to the engine and wrote
        self.records: dict[str, dict] = {}
        self.cancelled = False
        self._tasks: list[asyncio.Task] = []

    @property
    def complete(self) -> bool:
        return len(self.records) == len(self.lines)

    def cancel(self) -> None:
        """Stop: requests in flight are cancelled, the lines written so far stay."""
        self.cancelled = True
        for task in self._tasks:
            task.cancel()

    async def run(self) -> Progress:
        ids = {line.custom_id for line in self.lines}
        self.records = await asyncio.to_thread(self.output.load, ids)
        progress = self.progress
        progress.resumed = progress.done = len(self.records)
        progress.failed = sum(not succeeded(r) for r in self.records.values())
        self._report()
        queue: asyncio.Queue[BatchLine] = asyncio.Queue()
        for line in self.lines:
            if line.custom_id not in self.records:
                queue.put_nowait(line)
        workers = min(self.concurrency, queue.qsize())
        self._tasks = [asyncio.ensure_future(self._work(queue)) for _ in range(workers)]
        try:
            if self._tasks:
                await asyncio.gather(*self._tasks)
        except asyncio.CancelledError:
            if not self.cancelled:
                self.cancel()
                raise
        finally:
            for task in self._tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*self._tasks, return_exceptions=True)
            progress.finished = time.monotonic()
        if self.complete:
            order = [self.records[line.custom_id] for line in self.lines]
            await asyncio.to_thread(self.output.rewrite, order)
        self._report()
        return progress

    async def _engine_ready(self) -> Engine:
        while True:
            engine = self._engine()
            if engine is not None and engine.status == "ready":
                return engine
            await asyncio.sleep(ENGINE_WAIT_S)

    async def _work(self, queue: asyncio.Queue[BatchLine]) -> None:
        while not queue.empty():
            line = queue.get_nowait()
            record = await self._compute(line)
            await asyncio.to_thread(self.output.append, record)
            self.records[line.custom_id] = record
            self.computed += 1
            self.progress.done += 1
            if succeeded(record):
                usage = record["response"]["body"].get("usage") or {}
                self.progress.tokens += usage.get("completion_tokens", 0)
            else:
                self.progress.failed += 1
            self._report()

    async def _compute(self, line: BatchLine) -> dict:
        """The line's record; a request the engine dropped unfinished (it stopped or is
        restarting: a cancelled reply, or an error while it is not serving) runs again
        once it serves."""
        while True:
            engine = await self._engine_ready()
            try:
                submitted = await submit_parsed(engine, line.parsed, line.chat, self.session_id,
                                                priority=Priority.BACKGROUND)
                body = await answer(submitted)
            except APIError as exc:
                if engine.status != "ready":
                    continue
                return failure_record(line.custom_id, exc)
            if any(c.get("finish_reason") == "cancelled" for c in body["choices"]):
                await asyncio.sleep(ENGINE_WAIT_S)  # the engine is stopping: wait for it
                continue
            return success_record(line.custom_id, body)

    def _report(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.progress)
