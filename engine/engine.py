"""The engine: one background thread that owns every MLX call and batches all chats.

Other threads talk to it only through a thread-safe inbox (submit, cancel, stop) and read
back per-request event streams (``RequestHandle``) and immutable pool snapshots. Nothing a
caller does can raise inside the engine thread: bad requests end with an ``error`` event, a
failing step fails only the requests involved (engine/step.py), and the thread keeps serving
the others. This module is the thread shell and the load wiring; a step, its output and its
telemetry live in their own modules.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import queue
import threading
import traceback
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import mlx.core as mx

from engine import attention, fallback
from engine.admission import admit, apply_template
from engine.blocks import BlockAllocator
from engine.config import (
    EngineConfig,
    SamplingParams,
    blocks_for_budget,
    check_top_k,
    overlap_steps,
)
from engine.errors import ModelLoadError
from engine.events import EngineStatus, FinishReason, ModelInfo, PoolSnapshot
from engine.handle import RequestHandle
from engine.kv_pool import KVPool, KVShape
from engine.memory import check_fits
from engine.model_adapter import (
    PROVEN_ARCHITECTURES,
    PagedModel,
    check_paged_matches,
    probe_kv_shape,
    recurrent_caches,
    sliding_windows,
    weights_nbytes,
)
from engine.models import LoadedModel, dtype_name, load_model
from engine.output import Output, refuse
from engine.prefill_budget import MIN_PROMPT_TOKENS, PrefillBudget
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
    handle: RequestHandle | None = None  # one request (by handle: ids may be reused)
    session_id: str | None = None


_STOP = object()


class Engine:
    """See docs/ARCHITECTURE.md §3.9 for the contract; README.md shows its use."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._ids = itertools.count(1)
        # Guards the inbox's open/closed state and the live request ids, so a submit either
        # lands before stop()'s _STOP (and is answered by the thread) or sees it closed.
        self._lock = threading.Lock()
        self._open = False
        self._started = False
        self._live: dict[str, RequestHandle] = {}
        self.status = EngineStatus.STOPPED
        self.load_error: str | None = None
        self.model_info: ModelInfo | None = None
        self._loaded: LoadedModel | None = None
        self.telemetry = Telemetry()

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; it loads the model, then serves. Returns at once.

        An engine can be started again after stop(): it loads the model afresh."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("the engine is already started")
            self._inbox = queue.Queue()
            self._ready.clear()
            self.load_error = None
            self.telemetry = Telemetry()
            # A restart loads the model and allocates the pool afresh: let the old ones go
            # first, so memory never holds two of each.
            self._loaded = self.model_info = None
            self.pool = self.paged_model = self.stepper = None
            self.status = EngineStatus.LOADING
            self._thread = threading.Thread(target=self._run, name="pagedchat-engine",
                                            daemon=True)
            self._open = self._started = True
            self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded (True) or failed to load / timed out (False)."""
        self._ready.wait(timeout)
        return self.status is EngineStatus.READY

    def stop(self, timeout: float | None = 30.0) -> None:
        """Cancel every request and end the thread; every handle gets its final events.

        Submits that race it either reach the thread before the stop (and end cancelled)
        or find the engine closed (and end with an error at once): none is lost."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._open = False
            self._inbox.put(_STOP)
        thread.join(timeout)
        with self._lock:
            if self._thread is thread:
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
        template is applied) or raw ``prompt_tokens``.

        Bad input raises ValueError here, in the caller's thread, naming what is wrong; a
        request id that a live request holds is refused. Before start() this raises
        RuntimeError; after stop() the handle ends at once with an error final."""
        messages, prompt_tokens = _checked_prompt(messages, prompt_tokens)
        params = _checked_params(params)
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string naming the chat, "
                             f"got {session_id!r}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be None or a non-empty string, got {request_id!r}")
        loaded = self._loaded
        if loaded is not None:
            check_top_k(params, _vocab_size(loaded.tokenizer))
        with self._lock:
            if not self._started:
                raise RuntimeError("the engine is not running: call start() first")
            request_id = request_id or f"req-{next(self._ids)}"
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already used by a request that "
                                 "has not ended: give each request its own id")
            if self._open:
                handle = RequestHandle(request_id, session_id, params.n, self._request_cancel,
                                       on_done=self._release_id)
                self._live[request_id] = handle
                self._inbox.put(_Submit(request_id, session_id, messages, prompt_tokens,
                                        params, handle))
                return handle
        handle = RequestHandle(request_id, session_id, params.n, self._request_cancel)
        refuse(handle, params.n, FinishReason.ERROR,
               "the engine stopped: start it again to generate")
        return handle

    def _release_id(self, handle: RequestHandle) -> None:
        """A request ended: its id may be used again (called before its last final shows)."""
        with self._lock:
            if self._live.get(handle.request_id) is handle:
                del self._live[handle.request_id]

    def cancel_session(self, session_id: str) -> None:
        """Cancel every request of a chat (for a deleted chat) and forget its stats."""
        self._inbox.put(_Cancel(session_id=session_id))

    def _request_cancel(self, handle: RequestHandle) -> None:
        self._inbox.put(_Cancel(handle=handle))

    # ---- queries (any thread) ---------------------------------------------------------------

    def snapshot(self) -> PoolSnapshot | None:
        """The latest pool snapshot (immutable; None until the model is loaded)."""
        return self.telemetry.snapshot

    def count_tokens(self, messages: Seq[dict]) -> int:
        """Prompt tokens of ``messages`` after the chat template (0 before the model loads)."""
        loaded = self._loaded
        if loaded is None:
            return 0
        return len(apply_template(loaded.tokenizer, _checked_messages(messages)))

    def encode_chat(self, messages: Seq[dict], add_generation_prompt: bool = True) -> list[int]:
        """The token ids the engine would feed for ``messages`` (needs the model loaded)."""
        loaded = self._loaded
        if loaded is None:
            raise RuntimeError("the model is not loaded yet")
        return apply_template(loaded.tokenizer, _checked_messages(messages),
                              add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """The token ids of plain ``text``, no chat template (a raw completion prompt)."""
        if self._loaded is None:
            raise RuntimeError("the model is not loaded yet")
        return list(self._loaded.tokenizer.encode(text))

    def decode(self, token_ids: Seq[int]) -> str:
        if self._loaded is None:
            return ""
        return self._loaded.tokenizer.decode(list(token_ids))

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # MLX keeps per-thread streams; left to the thread's exit they are torn down
            # after the interpreter has started finalizing, which aborted scripts at exit
            # ("terminate called without an active exception", rc 134). MLX's maintainers
            # ask threads to clear them themselves (ml-explore/mlx#3395).
            mx.clear_streams()

    def _serve(self) -> None:
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
        self.stepper.discard_inflight()
        self.output.finish_all(FinishReason.CANCELLED)
        self._answer_queued(FinishReason.CANCELLED, "the engine stopped")
        self._publish(force=True)

    def _load(self) -> None:
        cfg = self.config
        loaded = load_model(cfg.model, cfg.quantized)
        try:
            shape = self._kv_shape(loaded)
            if loaded.model_type not in PROVEN_ARCHITECTURES:
                self._verify_architecture(loaded, shape)
        except fallback.NotPaged as reason:  # mlx-lm's own batching serves it, unpaged
            self._load_fallback(loaded, str(reason))
            return
        num_blocks = blocks_for_budget(shape.bytes_per_token(), cfg.block_size, cfg.kv_memory_mib)
        try:
            check_fits(num_blocks * shape.bytes_per_token() * cfg.block_size,
                       weights_nbytes(loaded.model))
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
        use_kernel = cfg.attention == "kernel" or (
            cfg.attention == "auto" and attention.kernel_available()
        )
        self.pool = KVPool(shape, num_blocks, cfg.block_size)
        self.alloc = BlockAllocator(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.alloc, cfg.max_batch, cfg.prefill_chunk)
        self.paged_model = PagedModel(loaded.model, self.pool, use_kernel=use_kernel)
        self.max_context = min(cfg.max_context or loaded.max_context, loaded.max_context)
        self.output = Output(self.scheduler, self.telemetry,
                             set(loaded.tokenizer.eos_token_ids), self.max_context)
        prefill = PrefillBudget(cfg.prefill_chunk, MIN_PROMPT_TOKENS, cfg.prefill_target)
        self.stepper = StepRunner(self.scheduler, self.pool, self.paged_model, self.output,
                                  self.telemetry, prefill,
                                  overlap=overlap_steps(cfg, mx.default_device() == mx.gpu))
        self._loaded = loaded
        self.model_info = ModelInfo(
            name=loaded.name,
            model_type=loaded.model_type,
            max_context=self.max_context,
            block_size=cfg.block_size,
            num_blocks=num_blocks,
            bytes_per_block=self.pool.bytes_per_block,
            attention=(attention.kernel_path() or "reference") if use_kernel else "reference",
            path=str(loaded.path),
            kv_dtype=dtype_name(shape.dtype),
        )
        self._publish(force=True)

    def _load_fallback(self, loaded: LoadedModel, reason: str) -> None:
        """The hook for engine/fallback.py: the same loop, Output and API, on mlx-lm's
        BatchGenerator instead of the pool."""
        cfg = self.config
        try:
            check_fits(0, weights_nbytes(loaded.model))
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
        logger.info("%s runs on mlx-lm's own cache: %s", loaded.model_type, reason)
        self.max_context = min(cfg.max_context or loaded.max_context, loaded.max_context)
        self.alloc = fallback.NoPool(cfg.block_size)
        self.scheduler = fallback.FallbackScheduler(cfg.max_batch)
        self.output = Output(self.scheduler, self.telemetry,
                             set(loaded.tokenizer.eos_token_ids), self.max_context)
        self.stepper = fallback.FallbackRunner(loaded.model, self.scheduler, self.output,
                                               self.telemetry, self.max_context,
                                               cfg.prefill_chunk)
        self._loaded = loaded
        self.model_info = ModelInfo(
            name=loaded.name, model_type=loaded.model_type, max_context=self.max_context,
            block_size=cfg.block_size, num_blocks=0, bytes_per_block=0,
            attention=fallback.ATTENTION_NAME, path=str(loaded.path),
            kv_dtype=dtype_name(loaded.dtype), paged=False, not_paged_reason=reason,
        )
        self._publish(force=True)

    def _kv_shape(self, loaded: LoadedModel) -> KVShape:
        """The model's per-layer K/V shape; a model without attention K/V (a state-space
        model such as mamba) or with layers the pool cannot hold is not paged, by name."""
        recurrent = recurrent_caches(loaded.model)
        if recurrent:
            raise fallback.NotPaged(
                f"the {loaded.model_type!r} architecture keeps a recurrent state "
                f"({', '.join(recurrent)}) instead of attention keys and values, so it cannot "
                "run on PagedChat's paged KV pool")
        windows = [w for w in sliding_windows(loaded.model)
                   if w < min(self.config.max_context or loaded.max_context, loaded.max_context)]
        if windows:
            raise fallback.NotPaged(
                f"the {loaded.model_type!r} architecture uses sliding-window attention (a "
                f"window of {windows[0]} tokens), which PagedChat's paged KV pool does not "
                "model")
        try:
            return probe_kv_shape(loaded.model)
        except Exception as e:
            raise fallback.NotPaged(
                f"the {loaded.model_type!r} architecture does not run on PagedChat's paged KV "
                f"pool ({type(e).__name__}: {e})") from e

    def _verify_architecture(self, loaded: LoadedModel, shape: KVShape) -> None:
        """An architecture outside the proven list runs paged only if it agrees with mlx-lm's
        own cache on a short check; otherwise it is not paged (never run wrongly)."""
        tolerance = 1e-3 if shape.dtype == mx.float32 else 3e-2
        try:
            error = check_paged_matches(loaded.model, shape, self.config.block_size)
        except Exception as e:  # e.g. attention sinks: the paged router refuses them
            raise fallback.NotPaged(
                f"the {loaded.model_type!r} architecture does not run on PagedChat's paged KV "
                f"pool ({type(e).__name__}: {e})") from e
        if error > tolerance:
            raise fallback.NotPaged(
                f"the {loaded.model_type!r} architecture does not run on PagedChat's paged KV "
                f"pool (its output differs from mlx-lm's by {error:.1e})")
        logger.info("%s verified on the paged path (max rel. diff %.1e)", loaded.model_type, error)

    def _publish(self, force: bool = False) -> None:
        info = self.model_info
        self.telemetry.maybe_snapshot(
            self.alloc, self.scheduler, self.output.requests.values(),
            info.bytes_per_block if info else 0, info.name if info else "",
            force=force, paged=info.paged if info else True,
            kv_dtype=info.kv_dtype if info else "",
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
        """Admit one submission; whatever goes wrong ends this request alone, with an error
        final for each of its samples, and never reaches the loop's catch-all."""
        try:
            request, refusal = admit(
                item.request_id, item.session_id, item.messages, item.prompt_tokens,
                item.params, item.handle, self._loaded.tokenizer, self.max_context,
            )
            if refusal is not None:
                refuse(item.handle, item.handle.n, FinishReason.ERROR, refusal, request)
                return
            self.scheduler.add(request.sequences[0])  # samples 1.. fork after the prompt
        except Exception as e:
            logger.exception("request %s could not be accepted", item.request_id)
            refuse(item.handle, item.handle.n, FinishReason.ERROR,
                   f"the request could not be started: {type(e).__name__}: {e}")
            return
        self.output.requests[request.request_id] = request
        self.telemetry.add_session(item.session_id)

    def _cancel(self, item: _Cancel) -> None:
        if item.handle is not None:
            request = self.output.requests.get(item.handle.request_id)
            if request is not None and request.handle is item.handle:
                self.output.finish_request(request, FinishReason.CANCELLED)
            return
        requests = self.output.requests.values()
        for request in [r for r in requests if r.session_id == item.session_id]:
            self.output.finish_request(request, FinishReason.CANCELLED)
        self.telemetry.forget_session(item.session_id)


def _checked_prompt(messages, prompt_tokens) -> tuple[list[dict] | None, list[int] | None]:
    """Copies of the prompt arguments, or a ValueError saying what is wrong with them."""
    if (messages is None) == (prompt_tokens is None):
        raise ValueError("give either messages or prompt_tokens")
    if messages is not None:
        out = _checked_messages(messages)
        if not any(m["content"].strip() for m in out):
            raise ValueError("the conversation is empty: write a message first")
        return out, None
    if isinstance(prompt_tokens, str | bytes) or not isinstance(prompt_tokens, Seq):
        raise ValueError("prompt_tokens must be a list of token ids")
    tokens = []
    for t in prompt_tokens:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt_tokens must hold token ids (integers), got {t!r}")
        tokens.append(int(t))
    if not tokens:
        raise ValueError("prompt_tokens is empty")
    return None, tokens


def _checked_messages(messages) -> list[dict]:
    """Copies of chat messages, each with a text role and text content, or a ValueError."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Seq):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', "
                             f"got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i} needs a 'role' (such as 'user'), got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"message {i}'s 'content' must be text, got "
                             f"{type(content).__name__}")
        out.append(dict(m))
    return out


def _checked_params(params) -> SamplingParams:
    """``params`` validated again (a frozen dataclass can still be forced into a bad state)."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    return dataclasses.replace(params)


def _vocab_size(tokenizer) -> int:
    return max(tokenizer.vocab_size, len(tokenizer))
