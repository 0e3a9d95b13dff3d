"""The engine: one background thread that owns every MLX call and batches all chats.

Other threads talk to it only through a thread-safe inbox (submit, cancel, stop) and read
back per-request event streams (``RequestHandle``) and immutable pool snapshots. Nothing a
caller does can raise inside the engine thread: bad requests end with an ``error`` event, a
failing step fails only the requests involved (engine/step.py), and the thread keeps serving
the others. This module is the thread shell and the load wiring; a step, its output and its
telemetry live in their own modules.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import traceback
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import mlx.core as mx

from engine import attention
from engine.admission import admit, apply_template
from engine.blocks import BlockAllocator
from engine.config import EngineConfig, SamplingParams, blocks_for_budget
from engine.errors import ModelLoadError
from engine.events import EngineStatus, FinishReason, ModelInfo, PoolSnapshot
from engine.handle import RequestHandle
from engine.kv_pool import KVPool, KVShape
from engine.model_adapter import (
    PROVEN_ARCHITECTURES,
    PagedModel,
    check_paged_matches,
    probe_kv_shape,
)
from engine.models import LoadedModel, load_model
from engine.output import Output, refuse
from engine.scheduler import Scheduler
from engine.step import StepRunner, describe
from engine.telemetry import Telemetry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Submit:
    request_id: str
    session_id: str
    messages: list[dict] | None
    prompt_tokens: list[int] | None
    params: SamplingParams
    handle: RequestHandle


@dataclass(frozen=True)
class _Cancel:
    request_id: str | None = None
    session_id: str | None = None


_STOP = object()


class Engine:
    """See ARCHITECTURE.md 3.6 for the contract; README.md shows its use."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._ids = itertools.count(1)
        self.status = EngineStatus.STOPPED
        self.load_error: str | None = None
        self.model_info: ModelInfo | None = None
        self._loaded: LoadedModel | None = None
        self.telemetry = Telemetry()

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; it loads the model, then serves. Returns at once."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self.status = EngineStatus.LOADING
        self._thread = threading.Thread(target=self._run, name="pagedchat-engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded (True) or failed to load / timed out (False)."""
        self._ready.wait(timeout)
        return self.status is EngineStatus.READY

    def stop(self, timeout: float | None = 30.0) -> None:
        """Cancel every request and end the thread."""
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        self._thread = None
        self.status = EngineStatus.STOPPED

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests ---------------------------------------------------------------------------

    def submit(
        self,
        messages: Seq[dict] | None = None,
        prompt_tokens: Seq[int] | None = None,
        params: SamplingParams | None = None,
        session_id: str = "default",
        request_id: str | None = None,
    ) -> RequestHandle:
        """Queue a request; never blocks. Give either chat ``messages`` (the model's chat
        template is applied) or raw ``prompt_tokens``."""
        if (messages is None) == (prompt_tokens is None):
            raise ValueError("give either messages or prompt_tokens")
        if messages is not None:
            messages = [dict(m) for m in messages]
            if not messages or not any(str(m.get("content", "")).strip() for m in messages):
                raise ValueError("the conversation is empty: write a message first")
        if prompt_tokens is not None:
            prompt_tokens = [int(t) for t in prompt_tokens]
            if not prompt_tokens:
                raise ValueError("prompt_tokens is empty")
        if self._thread is None:
            raise RuntimeError("the engine is not running: call start() first")
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(request_id, session_id, params.n, self._request_cancel)
        self._inbox.put(_Submit(request_id, session_id, messages, prompt_tokens, params, handle))
        return handle

    def cancel_session(self, session_id: str) -> None:
        """Cancel every request of a chat (for a deleted chat) and forget its stats."""
        self._inbox.put(_Cancel(session_id=session_id))

    def _request_cancel(self, request_id: str) -> None:
        self._inbox.put(_Cancel(request_id=request_id))

    # ---- queries (any thread) ---------------------------------------------------------------

    def snapshot(self) -> PoolSnapshot | None:
        """The latest pool snapshot (immutable; None until the model is loaded)."""
        return self.telemetry.snapshot

    def count_tokens(self, messages: Seq[dict]) -> int:
        """Prompt tokens of ``messages`` after the chat template (0 before the model loads)."""
        if self._loaded is None:
            return 0
        return len(apply_template(self._loaded.tokenizer, list(messages)))

    def encode_chat(self, messages: Seq[dict], add_generation_prompt: bool = True) -> list[int]:
        """The token ids the engine would feed for ``messages`` (needs the model loaded)."""
        if self._loaded is None:
            raise RuntimeError("the model is not loaded yet")
        return apply_template(self._loaded.tokenizer, list(messages), add_generation_prompt)

    def decode(self, token_ids: Seq[int]) -> str:
        if self._loaded is None:
            return ""
        return self._loaded.tokenizer.decode(list(token_ids))

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._load()
        except Exception as e:  # the message is for the user; the traceback for the log
            logger.exception("model load failed")
            self.load_error = str(e) if isinstance(e, ModelLoadError) else describe(e)
            self.status = EngineStatus.ERROR
            self._ready.set()
            # Answer every request with the load error until stopped.
            self._answer_queued(FinishReason.ERROR, self.load_error, until_stop=True)
            return
        self.status = EngineStatus.READY
        self._ready.set()
        running = True
        while running:
            try:
                running = self._drain_inbox(block=not self.scheduler.has_work)
                if running and self.scheduler.has_work:
                    self.stepper.step()
                self._publish(force=not self.scheduler.has_work)
            except Exception:  # a bug outside any one request: fail what is running, go on
                logger.exception("engine loop error")
                message = traceback.format_exc(limit=2).strip().splitlines()[-1]
                self.output.finish_all(FinishReason.ERROR, f"engine error: {message}")
        self.output.finish_all(FinishReason.CANCELLED)
        self._answer_queued(FinishReason.CANCELLED, "the engine stopped")
        self._publish(force=True)

    def _load(self) -> None:
        cfg = self.config
        loaded = load_model(cfg.model, cfg.quantized)
        shape = probe_kv_shape(loaded.model)
        num_blocks = blocks_for_budget(shape.bytes_per_token(), cfg.block_size, cfg.kv_memory_mib)
        use_kernel = cfg.attention == "kernel" or (
            cfg.attention == "auto" and attention.kernel_available()
        )
        if loaded.model_type not in PROVEN_ARCHITECTURES:
            self._verify_architecture(loaded, shape)
        self.pool = KVPool(shape, num_blocks, cfg.block_size)
        self.alloc = BlockAllocator(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.alloc, cfg.max_batch, cfg.prefill_chunk)
        self.paged_model = PagedModel(loaded.model, self.pool, use_kernel=use_kernel)
        self.max_context = min(cfg.max_context or loaded.max_context, loaded.max_context)
        self.output = Output(self.scheduler, self.telemetry,
                             set(loaded.tokenizer.eos_token_ids), self.max_context)
        self.stepper = StepRunner(self.scheduler, self.pool, self.paged_model, self.output,
                                  self.telemetry)
        self._loaded = loaded
        self.model_info = ModelInfo(
            name=loaded.name,
            model_type=loaded.model_type,
            max_context=self.max_context,
            block_size=cfg.block_size,
            num_blocks=num_blocks,
            bytes_per_block=self.pool.bytes_per_block,
            attention="metal-kernel" if use_kernel else "reference",
        )
        self._publish(force=True)

    def _verify_architecture(self, loaded: LoadedModel, shape: KVShape) -> None:
        """An architecture outside the proven list runs paged only if it agrees with mlx-lm's
        own cache on a short check; otherwise it is refused, never run wrongly."""
        tolerance = 1e-3 if shape.dtype == mx.float32 else 3e-2
        error = check_paged_matches(loaded.model, shape, self.config.block_size)
        if error > tolerance:
            raise ModelLoadError(
                f"the {loaded.model_type!r} architecture is not supported on PagedChat's paged "
                f"KV pool (its output differs from mlx-lm's by {error:.1e}): choose a llama, "
                f"qwen2, qwen3, mistral, phi3 or gemma model"
            )
        logger.info("%s verified on the paged path (max rel. diff %.1e)", loaded.model_type, error)

    def _publish(self, force: bool = False) -> None:
        self.telemetry.maybe_snapshot(
            self.alloc, self.scheduler, self.output.requests.values(),
            self.pool.bytes_per_block, self.model_info.name if self.model_info else "",
            force=force,
        )

    def _answer_queued(self, reason: FinishReason, message: str | None,
                       until_stop: bool = False) -> None:
        """End every queued submission with ``reason`` (the engine cannot serve them)."""
        while True:
            try:
                item = self._inbox.get(block=until_stop)
            except queue.Empty:
                return
            if item is _STOP:
                return
            if isinstance(item, _Submit):
                refuse(item.handle, item.params.n, reason, message)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every queued command; False when asked to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is _STOP:
                return False
            if isinstance(item, _Submit):
                self._accept(item)
            elif isinstance(item, _Cancel):
                self._cancel(item)

    def _accept(self, item: _Submit) -> None:
        self.telemetry.add_session(item.session_id)
        request, refusal = admit(
            item.request_id, item.session_id, item.messages, item.prompt_tokens, item.params,
            item.handle, self._loaded.tokenizer, self.max_context,
        )
        if refusal is not None:
            refuse(request.handle, request.params.n, FinishReason.ERROR, refusal, request)
            return
        self.output.requests[request.request_id] = request
        self.scheduler.add(request.sequences[0])  # samples 1.. fork from it after the prompt

    def _cancel(self, item: _Cancel) -> None:
        if item.request_id is not None:
            request = self.output.requests.get(item.request_id)
            if request is not None:
                self.output.finish_request(request, FinishReason.CANCELLED)
            return
        requests = self.output.requests.values()
        for request in [r for r in requests if r.session_id == item.session_id]:
            self.output.finish_request(request, FinishReason.CANCELLED)
        self.telemetry.forget_session(item.session_id)
