"""The engine: one background thread that owns every MLX call and batches all chats.

Other threads talk to it only through a thread-safe inbox (submit, cancel, stop) and read
back per-request event streams (``RequestHandle``) and immutable pool snapshots. Nothing a
caller does can raise inside the engine thread: bad requests end with an ``error`` event, a
failing step fails only the requests involved (engine/runner/step.py), and the thread keeps serving
the others. This module is the thread shell: lifecycle, the public methods and the loop.
What it delegates, each to a module with that one job: the checks at the door
(engine/requests/validation.py), the inbox's messages and how they are applied
(engine/requests/inbox.py), the load wiring (engine/loading.py), a step, its output and its
telemetry (engine/runner/step.py, engine/runner/output.py, engine/runner/telemetry.py).
"""

from __future__ import annotations

import gc
import itertools
import logging
import queue
import threading
import traceback
from collections.abc import Sequence as Seq

import mlx.core as mx

from engine.config import EngineConfig, Priority, SamplingParams, check_top_k, checked_priority
from engine.errors import ModelLoadError
from engine.events import (
    ContextResidency,
    EngineStatus,
    FinishReason,
    ModelInfo,
    PoolSnapshot,
    ToolCallFormat,
)
from engine.handle import RequestHandle
from engine.loading import Runtime, load_runtime
from engine.requests import inbox
from engine.requests.admission import apply_template
from engine.requests.validation import (
    check_ids,
    checked_messages,
    checked_params,
    checked_prompt,
    vocab_size,
)
from engine.runner.constraints import grammars_for
from engine.runner.disk_sync import (
    IDLE_WRITE_BLOCKS,
    forget,
    full_block_hashes,
    put_to_sleep,
    residency,
)
from engine.runner.output import refuse
from engine.runner.step import describe
from engine.runner.telemetry import Telemetry

logger = logging.getLogger(__name__)


class Engine:
    """See docs/ARCHITECTURE.md §3.9 for the contract; README.md shows its use."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._ids = itertools.count(1)
        # Guards the inbox's open/closed state and the live request ids, so a submit either
        # lands before stop()'s inbox.STOP (and is answered by the thread) or sees it closed.
        self._lock = threading.Lock()
        self._open = False
        self._started = False
        self._live: dict[str, RequestHandle] = {}
        self.status = EngineStatus.STOPPED
        self.load_error: str | None = None
        self.model_info: ModelInfo | None = None
        #: Everything the loaded model runs on (engine/loading.py); None until loaded, and
        #: again once the engine thread has ended (its memory is given back at stop).
        self.runtime: Runtime | None = None
        #: What outlives a stop, for the queries and the checks at the door: the loaded
        #: model's tokenizer and its disk tier's files (None until loaded; no device memory).
        self._loaded_tokenizer = None
        self._disk_tier = None
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
            self.runtime = self.model_info = self._loaded_tokenizer = self._disk_tier = None
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
            self._inbox.put(inbox.STOP)
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
        priority: Priority = Priority.NORMAL,
        incognito: bool = False,
    ) -> RequestHandle:
        """Queue a request; never blocks. Give either chat ``messages`` (the model's chat
        template is applied) or raw ``prompt_tokens``. ``priority`` says who goes first when
        the batch, the pool or a step's prompt budget is short (``set_priority`` changes it
        while the request runs). ``incognito``: the request's blocks are never shared with
        another chat nor written to the disk tier, and are zeroed when released.

        Bad input raises ValueError here, in the caller's thread, naming what is wrong; a
        request id that a live request holds is refused. Before start() this raises
        RuntimeError; after stop() the handle ends at once with an error final."""
        messages, prompt_tokens = checked_prompt(messages, prompt_tokens)
        params = checked_params(params)
        priority = checked_priority(priority)
        check_ids(session_id, request_id)
        if not isinstance(incognito, bool):
            raise ValueError(f"incognito must be True or False, got {incognito!r}")
        if params.beam_width > self.config.max_batch:
            raise ValueError(f"beam_width must be at most the engine's max_batch "
                             f"({self.config.max_batch}): the beams decode side by side in one "
                             f"batch, got {params.beam_width}")
        tokenizer, info = self._loaded_tokenizer, self.model_info
        if tokenizer is not None and info is not None:
            check_top_k(params, vocab_size(tokenizer))
            if params.beam_search and not info.paged:
                raise ValueError("beam search needs the paged KV pool, and this model runs on "
                                 "mlx-lm's own cache: set beam_width to 1")
            if params.constraint is not None:  # a grammar the compiler refuses: refused here
                grammars_for(tokenizer).check(params.constraint)
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
                self._inbox.put(inbox.Submit(request_id, session_id, messages, prompt_tokens,
                                             params, handle, priority, incognito))
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

    def set_priority(self, session_id: str, priority: Priority) -> None:
        """Give every live request of a chat a new priority (the user focused its pane, or
        left it); never blocks. Requests submitted later carry their own."""
        check_ids(session_id, None)
        self._inbox.put(inbox.SetPriority(session_id, checked_priority(priority)))

    def cancel_session(self, session_id: str) -> None:
        """Cancel every request of a chat (for a deleted chat) and forget its stats."""
        self._inbox.put(inbox.Cancel(session_id=session_id))

    # ---- a conversation's context (the disk tier, docs/ARCHITECTURE.md §3.14) -----------------

    def context_residency(self, prompt_tokens: Seq[int]) -> ContextResidency:
        """Where a conversation's context is (its prompt's full blocks in the pool, on disk,
        or neither): hashing and index lookups in the caller's thread, never waits; all
        "recompute" before the model is loaded or when the model runs unpaged."""
        tokens = checked_prompt(None, prompt_tokens)[1]
        runtime = self.runtime
        if runtime is None or runtime.pool is None:
            return ContextResidency(max(0, (len(tokens) - 1) // self.config.block_size), 0, 0)
        tier = runtime.disk.tier if runtime.disk is not None else None
        return residency(runtime.alloc, tier, tokens)

    def sleep_context(self, prompt_tokens: Seq[int]) -> None:
        """Put a conversation to sleep: its cached blocks leave the pool (written to the disk
        tier first, when it is on); never blocks."""
        tokens = tuple(checked_prompt(None, prompt_tokens)[1])
        self._inbox.put(inbox.Context("sleep", tokens))

    def forget_context(self, prompt_tokens: Seq[int],
                       keep: Seq[Seq[int]] = ()) -> None:
        """Delete a conversation's blocks (a deleted chat) from the pool's cache and the disk
        tier, but for those any conversation of ``keep`` shares; never blocks."""
        tokens = tuple(checked_prompt(None, prompt_tokens)[1])
        kept = tuple(tuple(checked_prompt(None, k)[1]) for k in keep)
        self._inbox.put(inbox.Context("forget", tokens, kept))

    def pin_context(self, key: str, prompt_tokens: Seq[int] | None) -> None:
        """Keep a conversation warm: its cached blocks stay in the pool while other cached
        blocks can be evicted instead (``key`` names the pin, e.g. the chat's id; calling
        again with the grown conversation replaces it; None unpins). Never blocks."""
        check_ids(key, None)
        tokens = None if prompt_tokens is None else tuple(checked_prompt(None, prompt_tokens)[1])
        self._inbox.put(inbox.Context("pin", tokens or (), key=key, unpin=tokens is None))

    def clear_disk_cache(self) -> None:
        """Delete every file of the disk tier (every model's); no-op when it is off."""
        tier = self._disk_tier
        if tier is not None:
            tier.clear()

    def _request_cancel(self, handle: RequestHandle) -> None:
        self._inbox.put(inbox.Cancel(handle=handle))

    # ---- queries (any thread) ---------------------------------------------------------------

    def snapshot(self) -> PoolSnapshot | None:
        """The latest pool snapshot (immutable; None until the model is loaded).

        Never waits: asking is what makes the engine thread build the next one, between
        steps and at most every ``telemetry.SNAPSHOT_INTERVAL_S`` (engine/runner/telemetry.py),
        so nobody pays for snapshots nobody reads."""
        return self.telemetry.read()

    def count_tokens(self, messages: Seq[dict]) -> int:
        """Prompt tokens of ``messages`` after the chat template (0 before the model loads)."""
        tokenizer = self._loaded_tokenizer
        if tokenizer is None:
            return 0
        return len(apply_template(tokenizer, checked_messages(messages)))

    def encode_chat(self, messages: Seq[dict], add_generation_prompt: bool = True,
                    tools: Seq[dict] | None = None) -> list[int]:
        """The token ids the engine would feed for ``messages`` (needs the model loaded);
        ``tools``: function specs for a chat template that renders them."""
        return apply_template(self._tokenizer(), checked_messages(messages),
                              add_generation_prompt, list(tools) if tools else None)

    def tool_call_format(self) -> ToolCallFormat | None:
        """How this model writes a tool call, when mlx-lm knows its format (its tokenizer's
        tool parser), else None (needs the model loaded)."""
        tokenizer = self._tokenizer()
        if not getattr(tokenizer, "has_tool_calling", False):
            return None
        return ToolCallFormat(tokenizer.tool_call_start, tokenizer.tool_call_end,
                              tokenizer.tool_parser)

    def encode(self, text: str) -> list[int]:
        """The token ids of plain ``text``, no chat template (a raw completion prompt)."""
        return list(self._tokenizer().encode(text))

    def decode(self, token_ids: Seq[int]) -> str:
        """The text of ``token_ids`` ("" before the model loads)."""
        tokenizer = self._loaded_tokenizer
        if tokenizer is None:
            return ""
        return tokenizer.decode(list(token_ids))

    def _tokenizer(self):
        tokenizer = self._loaded_tokenizer
        if tokenizer is None:
            raise RuntimeError("the model is not loaded yet")
        return tokenizer

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # A stopped engine gives its memory back at once: no weights, no pool (its
            # tokenizer, model_info and disk tier's files stay, for queries). The
            # runtime's parts hold callbacks into each other (bound methods), so dropping
            # it leaves cycles that only the cyclic collector frees, whenever it happens to
            # run: the app's model switch loaded the new model beside the old one, and an
            # engine of the default model kept its 770 MiB after stop() until a
            # gc.collect(). So the collector runs once here, as the thread ends.
            self.runtime = None
            gc.collect()
            # MLX keeps per-thread streams; left to the thread's exit they are torn down
            # after the interpreter has started finalizing, which aborted scripts at exit
            # ("terminate called without an active exception", rc 134). MLX's maintainers
            # ask threads to clear them themselves (ml-explore/mlx#3395).
            mx.clear_streams()

    def _serve(self) -> None:
        try:
            self.runtime = rt = load_runtime(self.config, self.telemetry,
                                             wake=self._wake)
            self._loaded_tokenizer = rt.loaded.tokenizer
            self._disk_tier = rt.disk.tier if rt.disk is not None else None
            self.model_info = rt.model_info
            self._publish(force=True)
        except Exception as e:  # the message is for the user; the traceback for the log
            logger.exception("model load failed")
            self.load_error = str(e) if isinstance(e, ModelLoadError) else describe(e)
            self.status = EngineStatus.ERROR
            self._ready.set()
            # Answer every request with the load error until stopped.
            inbox.answer_queued(self._inbox, FinishReason.ERROR, self.load_error,
                                until_stop=True)
            return
        self.status = EngineStatus.READY
        self._ready.set()
        running = True
        while running:
            try:
                idle = not rt.scheduler.has_work
                if idle and rt.pool is not None:
                    rt.stepper.zero_released()  # an incognito chat ended: zeroed at once
                if rt.disk is not None:
                    if idle:  # write the open chats' blocks while nothing else runs
                        self._write_while_idle(rt.disk)
                    # the reader wakes it (unless an answer is half written: go on)
                    idle = idle or (rt.scheduler.only_reading_disk
                                    and not rt.disk.restoring)
                running = self._drain_inbox(block=idle)
                rt.stepper.release_finished()  # what the commands ended (cancels)
                if running and rt.scheduler.has_work:
                    rt.stepper.step()  # it releases what it ended itself
                self._publish(force=not rt.scheduler.has_work)
            except Exception:  # a bug outside any one request: fail what is running, go on
                logger.exception("engine loop error")
                message = traceback.format_exc(limit=2).strip().splitlines()[-1]
                rt.output.finish_all(FinishReason.ERROR, f"engine error: {message}")
                rt.stepper.release_finished()
        rt.stepper.discard_inflight()
        rt.output.finish_all(FinishReason.CANCELLED)
        rt.stepper.release_finished()
        inbox.answer_queued(self._inbox, FinishReason.CANCELLED, "the engine stopped")
        if rt.pool is not None:
            rt.stepper.zero_released()
        if rt.disk is not None:
            try:  # the open chats' blocks, on disk before the engine ends
                rt.disk.close()
            except Exception:
                logger.exception("the KV disk tier failed to close")
        self._publish(force=True)

    def _wake(self) -> None:
        """The disk tier's reader answered, or its writer has room again: a sleeping engine
        thread looks again."""
        self._inbox.put(inbox.WAKE)

    def _write_while_idle(self, disk) -> None:
        """Copy off the blocks named since the last step, a batch at a time, until done or
        something arrives in the inbox."""
        disk.restore()
        while disk.pending_writes and self._inbox.empty():
            disk.write_through(IDLE_WRITE_BLOCKS)

    def _publish(self, force: bool = False) -> None:
        """A snapshot if one was asked for (rate-limited), or ``force``: the engine going
        idle always publishes, so the state it rests in is the one shown."""
        rt = self.runtime
        info = rt.model_info
        self.telemetry.maybe_snapshot(
            rt.alloc, rt.scheduler, rt.output.requests.values(), info.bytes_per_block,
            info.name, force=force, paged=info.paged, kv_dtype=info.kv_dtype,
            full_bytes_per_block=info.full_bytes_per_block,
            disk=rt.disk.tier if rt.disk is not None else None,
        )

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every queued command; False when asked to stop."""
        rt = self.runtime
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is inbox.STOP:
                return False
            if item is inbox.WAKE:
                continue
            if isinstance(item, inbox.Submit):
                inbox.accept(item, rt.loaded.tokenizer, rt.max_context, rt.scheduler,
                             rt.output, self.telemetry)
            elif isinstance(item, inbox.Cancel):
                inbox.cancel(item, rt.output, self.telemetry)
            elif isinstance(item, inbox.SetPriority):
                inbox.set_priority(item, rt.scheduler, self.telemetry)
            elif isinstance(item, inbox.Context) and rt.pool is not None:
                if item.action == "pin":
                    rt.alloc.pin(item.key, None if item.unpin else
                                 full_block_hashes(item.tokens, rt.alloc.block_size))
                elif item.action == "sleep":
                    put_to_sleep(rt.disk, rt.alloc, item.tokens)
                else:
                    forget(rt.disk, rt.alloc, item.tokens, item.keep)
