"""OpenAI's /v1/files and /v1/batches on the server: upload a batch input file, run it in the
background on the same engine (background priority, so the chats go first), download the
output. docs/ARCHITECTURE.md §7.

Files live in a folder of their own (``<id>`` holds the bytes, ``<id>.json`` the metadata);
each batch is ``batches/<id>.json`` plus its output as batch.py appends it, so a server
restarted in the middle of a batch goes on with it where it stopped (batch.py's resume).
Metadata is written to a temporary file and renamed: a crash never leaves half of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.server.batch import (
    ENDPOINTS,
    BatchInputError,
    BatchJob,
    OutputFile,
    check_models,
    read_input,
    succeeded,
)
from app.server.errors import APIError
from engine import Engine

DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
FILE_PURPOSES = ("batch", "batch_output", "user_data", "assistants", "fine-tune", "evals")
COMPLETION_WINDOWS = ("24h",)
MAX_ERRORS_REPORTED = 100
BATCH_CONCURRENCY = 16
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")


def default_files_dir() -> Path:
    """Where ``pagedchat serve`` keeps files and batches, without Qt: the platform's app-data
    folder (as the app's), in a folder of its own."""
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "PagedChat" / "api-files"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _not_found(kind: str, ident: str) -> APIError:
    return APIError(404, f"no {kind} with id {ident!r}", code="not_found")


class FileStore:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def _meta(self, file_id: str) -> Path:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise _not_found("file", file_id)
        return self.folder / f"{file_id}.json"

    def path(self, file_id: str) -> Path:
        self.get(file_id)
        return self.folder / file_id

    def add(self, filename: str, purpose: str, data: bytes) -> dict:
        file_id = "file-" + uuid.uuid4().hex
        with open(self.folder / file_id, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        meta = {"id": file_id, "object": "file", "bytes": len(data),
                "created_at": int(time.time()), "filename": filename, "purpose": purpose,
                "status": "processed", "status_details": None, "expires_at": None}
        _write_json(self._meta(file_id), meta)
        return meta

    def get(self, file_id: str) -> dict:
        try:
            return json.loads(self._meta(file_id).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise _not_found("file", file_id) from None

    def list(self, purpose: str | None = None) -> list[dict]:
        files = []
        for meta in self.folder.glob("file-*.json"):
            with contextlib.suppress(OSError, ValueError):
                files.append(json.loads(meta.read_text(encoding="utf-8")))
        files.sort(key=lambda f: (f["created_at"], f["id"]), reverse=True)
        return [f for f in files if purpose is None or f["purpose"] == purpose]

    def delete(self, file_id: str) -> dict:
        meta = self._meta(file_id)
        self.get(file_id)
        (self.folder / file_id).unlink(missing_ok=True)
        meta.unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}


class BatchManager:
    """The server's batches: their records on disk and the jobs running them on the loop."""

    def __init__(self, folder: Path, engine: Callable[[], Engine | None],
                 aliases: tuple[str, ...], concurrency: int = BATCH_CONCURRENCY) -> None:
        self.files = FileStore(folder)
        self.folder = folder / "batches"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.engine = engine
        self.aliases = aliases
        self.concurrency = concurrency
        self.jobs: dict[str, BatchJob] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.batches: dict[str, dict] = {}
        for path in self.folder.glob("batch_*.json"):
            with contextlib.suppress(OSError, ValueError):
                batch = json.loads(path.read_text(encoding="utf-8"))
                self.batches[batch["id"]] = batch

    # ---- records ----------------------------------------------------------------------------

    def _save(self, batch: dict) -> None:
        _write_json(self.folder / f"{batch['id']}.json", batch)

    def get(self, batch_id: str) -> dict:
        batch = self.batches.get(batch_id)
        if batch is None:
            raise _not_found("batch", batch_id)
        return batch

    def list(self) -> list[dict]:
        return sorted(self.batches.values(), key=lambda b: (b["created_at"], b["id"]),
                      reverse=True)

    def create(self, input_file_id: str, endpoint: str, window: str,
               metadata: dict | None) -> dict:
        meta = self.files.get(input_file_id)
        if meta["purpose"] != "batch":
            raise APIError(400, f"file {input_file_id} was uploaded with purpose "
                           f"{meta['purpose']!r}; a batch's input needs purpose 'batch'",
                           param="input_file_id", code="invalid_value")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got "
                           f"{endpoint!r}", param="endpoint", code="invalid_value")
        if window not in COMPLETION_WINDOWS:
            raise APIError(400, f"completion_window must be {COMPLETION_WINDOWS[0]!r}, got "
                           f"{window!r}", param="completion_window", code="invalid_value")
        now = int(time.time())
        batch = {
            "id": "batch_" + uuid.uuid4().hex, "object": "batch", "endpoint": endpoint,
            "errors": None, "input_file_id": input_file_id, "completion_window": window,
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + 24 * 3600,
            "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        self.batches[batch["id"]] = batch
        self._save(batch)
        self.start(batch)
        return batch

    def session_id(self, batch_id: str) -> str:
        return f"batch:{batch_id.removeprefix('batch_')[:8]}"

    # ---- running ----------------------------------------------------------------------------

    def start(self, batch: dict) -> None:
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self.tasks[batch["id"]] = task
        task.add_done_callback(lambda _t: self.tasks.pop(batch["id"], None))

    def resume_unfinished(self) -> None:
        """On startup: go on with every batch a previous run left unfinished."""
        for batch in self.list():
            if batch["status"] == "cancelling":
                self._finish(batch, "cancelled", self._output(batch["id"]).load())
            elif batch["status"] in UNFINISHED and batch["id"] not in self.tasks:
                self.start(batch)

    def _output(self, batch_id: str) -> OutputFile:
        return OutputFile(self.folder / f"{batch_id}.results.jsonl")

    async def _run(self, batch: dict) -> None:
        batch_id = batch["id"]
        try:
            lines, errors = await asyncio.to_thread(
                read_input, self.files.path(batch["input_file_id"]), batch["endpoint"])
        except (BatchInputError, APIError) as exc:
            errors, lines = [], []
            batch["errors"] = {"object": "list", "data": [
                {"code": "invalid_file", "message": str(exc), "param": None, "line": None}]}
        if not errors and lines:
            engine = await self._ready_engine()
            lines, errors = check_models(lines, engine, self.aliases)
        if errors or not lines:
            if errors:
                batch["errors"] = {"object": "list", "data": [
                    {"code": "invalid_request", "message": e.message, "param": None,
                     "line": e.number} for e in errors[:MAX_ERRORS_REPORTED]]}
            self._set(batch, "failed")
            return
        batch["request_counts"]["total"] = len(lines)
        if batch["status"] == "validating":
            self._set(batch, "in_progress")

        def progress(p) -> None:
            batch["request_counts"] = {"total": p.total, "completed": p.done - p.failed,
                                       "failed": p.failed}

        job = BatchJob(lines, self._output(batch_id), self.engine, self.session_id(batch_id),
                       concurrency=self.concurrency, on_progress=progress)
        self.jobs[batch_id] = job
        try:
            await job.run()
        finally:
            self.jobs.pop(batch_id, None)
        if job.cancelled:
            self._finish(batch, "cancelled", job.records)
        elif job.complete:
            self._set(batch, "finalizing")
            self._finish(batch, "completed", job.records)
        else:  # a shutdown: the record stays in_progress and the next start goes on
            self._save(batch)

    async def _ready_engine(self) -> Engine:
        while True:
            engine = self.engine()
            if engine is not None and engine.status == "ready":
                return engine
            await asyncio.sleep(0.5)

    def _set(self, batch: dict, status: str) -> None:
        batch["status"] = status
        batch[f"{status}_at"] = int(time.time())
        self._save(batch)

    def _finish(self, batch: dict, status: str, records: dict[str, dict]) -> None:
        """Split the results as OpenAI does: the output file holds the successes, the error
        file the failures; then the final status."""
        good = [r for r in records.values() if succeeded(r)]
        bad = [r for r in records.values() if not succeeded(r)]
        for kind, rows in (("output", good), ("error", bad)):
            if rows:
                data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
                meta = self.files.add(f"{batch['id']}_{kind}.jsonl", "batch_output",
                                      data.encode("utf-8"))
                batch[f"{kind}_file_id"] = meta["id"]
        counts = batch["request_counts"]
        counts.update(completed=len(good), failed=len(bad))
        self._set(batch, status)

    def cancel(self, batch_id: str) -> dict:
        batch = self.get(batch_id)
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            raise APIError(409, f"batch {batch_id} is {batch['status']}: it cannot be "
                           "cancelled", code="invalid_state")
        self._set(batch, "cancelling")
        job = self.jobs.get(batch_id)
        if job is not None:
            job.cancel()
        else:
            task = self.tasks.get(batch_id)
            if task is not None:
                task.cancel()  # still validating: nothing ran yet
            self._finish(batch, "cancelled", {})
        return batch

    def stop_jobs(self) -> None:
        """Stop the jobs (on the loop) without cancelling their batches: the next start of
        the server goes on with them."""
        for task in list(self.tasks.values()):
            task.cancel()


# ---- routes -------------------------------------------------------------------------------


def batch_routes(manager: BatchManager, authorise: Callable[[Request], None],
                 max_file_bytes: int, read_json) -> list[Route]:
    async def upload(request: Request) -> Response:
        authorise(request)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_file_bytes + 65536:
            raise APIError(413, f"the file is larger than {max_file_bytes} bytes",
                           code="request_too_large")
        try:
            async with request.form(max_files=1, max_fields=8,
                                    max_part_size=max_file_bytes) as form:
                upload = form.get("file")
                purpose = form.get("purpose")
                if upload is None or isinstance(upload, str):
                    raise APIError(400, "send the file as the multipart field 'file'",
                                   param="file", code="invalid_value")
                if purpose not in FILE_PURPOSES:
                    raise APIError(400, f"purpose must be one of {', '.join(FILE_PURPOSES)}, "
                                   f"got {purpose!r}", param="purpose", code="invalid_value")
                data = await upload.read()
                filename = upload.filename or "upload.jsonl"
        except APIError:
            raise
        except Exception as exc:  # a malformed or too large multipart body
            raise APIError(400, f"the upload could not be read: {exc}",
                           code="invalid_request") from exc
        if len(data) > max_file_bytes:
            raise APIError(413, f"the file is larger than {max_file_bytes} bytes",
                           code="request_too_large")
        meta = await asyncio.to_thread(manager.files.add, filename, purpose, data)
        return JSONResponse(meta)

    async def list_files(request: Request) -> Response:
        authorise(request)
        files = manager.files.list(request.query_params.get("purpose"))
        return JSONResponse({"object": "list", "data": files, "has_more": False,
                             "first_id": files[0]["id"] if files else None,
                             "last_id": files[-1]["id"] if files else None})

    async def get_file(request: Request) -> Response:
        authorise(request)
        return JSONResponse(manager.files.get(request.path_params["file_id"]))

    async def delete_file(request: Request) -> Response:
        authorise(request)
        return JSONResponse(manager.files.delete(request.path_params["file_id"]))

    async def file_content(request: Request) -> Response:
        authorise(request)
        path = manager.files.path(request.path_params["file_id"])
        data = await asyncio.to_thread(path.read_bytes)
        return Response(data, media_type="application/jsonl")

    async def create_batch(request: Request) -> Response:
        authorise(request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str):
                raise APIError(400, f"{name} is required (a string)", param=name,
                               code="invalid_value")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise APIError(400, "metadata must be an object", param="metadata",
                           code="invalid_type")
        return JSONResponse(manager.create(body["input_file_id"], body["endpoint"],
                                           body["completion_window"], metadata))

    async def list_batches(request: Request) -> Response:
        authorise(request)
        batches = manager.list()
        after = request.query_params.get("after")
        if after:
            ids = [b["id"] for b in batches]
            batches = batches[ids.index(after) + 1:] if after in ids else []
        try:
            limit = max(1, min(100, int(request.query_params.get("limit", 20))))
        except ValueError:
            raise APIError(400, "limit must be an integer", param="limit",
                           code="invalid_type") from None
        page = batches[:limit]
        return JSONResponse({"object": "list", "data": page, "has_more": len(batches) > limit,
                             "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None})

    async def get_batch(request: Request) -> Response:
        authorise(request)
        return JSONResponse(manager.get(request.path_params["batch_id"]))

    async def cancel_batch(request: Request) -> Response:
        authorise(request)
        return JSONResponse(manager.cancel(request.path_params["batch_id"]))

    return [
        Route("/v1/files", upload, methods=["POST"]),
        Route("/v1/files", list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", get_file, methods=["GET"]),
        Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
        Route("/v1/batches", create_batch, methods=["POST"]),
        Route("/v1/batches", list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
    ]
