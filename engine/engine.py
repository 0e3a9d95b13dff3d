"""The engine: one background thread that owns every MLX call and batches all chats.

Other threads talk to it only through a thread-safe inbox (submit, cancel, stop) and read
back per-request event streams (``RequestHandle``) and immutable pool snapshots. Nothing a
caller does can raise inside the engine thread: bad requests end with an ``error`` event, a
failing step fails only the requests involved, and the thread keeps serving the others.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import mlx.core as mx

from engine import attention
from engine.blocks import BlockAllocator
from engine.config import EngineConfig, SamplingParams
from engine.events import (
    Counters,
    FinalEvent,
    FinishReason,
    ModelInfo,
    PoolSnapshot,
    SequenceState,
    SessionStats,
    TokenEvent,
    Usage,
)
from engine.handle import RequestHandle
from engine.kv_pool import KVPool, blocks_for_budget
from engine.model_adapter import (
    PROVEN_ARCHITECTURES,
    PagedModel,
    SequenceWork,
    build_step_batch,
    check_paged_matches,
    probe_kv_shape,
)
from engine.models import LoadedModel, ModelLoadError, load_model
from engine.sampling import new_key, sample_next
from engine.scheduler import ScheduledWork, Scheduler, StepPlan
from engine.sequence import Request, Sequence

logger = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.05
RATE_WINDOW_S = 2.0


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


class _Rate:
    """Tokens per second over a sliding window."""

    def __init__(self) -> None:
        self._events: deque[tuple[float, int]] = deque()

    def add(self, now: float, n: int) -> None:
        self._events.append((now, n))

    def per_second(self, now: float) -> float:
        while self._events and self._events[0][0] < now - RATE_WINDOW_S:
            self._events.popleft()
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 0.25)
        return sum(n for _, n in self._events) / span


class Engine:
    """See ARCHITECTURE.md 3.6 for the contract; README.md shows its use."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._ids = itertools.count(1)
        self.status = "stopped"
        self.load_error: str | None = None
        self.model_info: ModelInfo | None = None
        self._loaded: LoadedModel | None = None
        self._snapshot: PoolSnapshot | None = None
        self._requests: dict[str, Request] = {}
        self._session_rates: dict[str, _Rate] = {}
        self._known_sessions: dict[str, None] = {}
        self._rate = _Rate()
        self._generated = 0
        self._step_ms = 0.0
        self._sched_ms = 0.0
        self._batch = 0
        self._last_snapshot = 0.0
        self.fault_injector = None  # tests: callable(seq) raising to simulate a failing request

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; it loads the model, then serves. Returns at once."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self.status = "loading"
        self._thread = threading.Thread(target=self._run, name="pagedchat-engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded (True) or failed to load / timed out (False)."""
        self._ready.wait(timeout)
        return self.status == "ready"

    def stop(self, timeout: float | None = 30.0) -> None:
        """Cancel every request and end the thread."""
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        self._thread = None
        self.status = "stopped"

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
        return self._snapshot

    def count_tokens(self, messages: Seq[dict]) -> int:
        """Prompt tokens of ``messages`` after the chat template (0 before the model loads)."""
        if self._loaded is None:
            return 0
        return len(self._apply_template(list(messages)))

    def encode_chat(self, messages: Seq[dict], add_generation_prompt: bool = True) -> list[int]:
        """The token ids the engine would feed for ``messages`` (needs the model loaded)."""
        if self._loaded is None:
            raise RuntimeError("the model is not loaded yet")
        return self._apply_template(list(messages), add_generation_prompt)

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
            self._load()
        except Exception as e:  # the message is for the user; the traceback for the log
            logger.exception("model load failed")
            self.load_error = str(e) if isinstance(e, ModelLoadError) else _describe(e)
            self.status = "error"
            self._ready.set()
            self._drain_after_failure()
            return
        self.status = "ready"
        self._ready.set()
        running = True
        while running:
            try:
                running = self._drain_inbox(block=not self.scheduler.has_work)
                if running and self.scheduler.has_work:
                    self._step()
                self._maybe_snapshot(force=not self.scheduler.has_work)
            except Exception:  # a bug outside any one request: fail what is running, go on
                logger.exception("engine loop error")
                message = traceback.format_exc(limit=2).strip().splitlines()[-1]
                for request in list(self._requests.values()):
                    self._finish_request(request, FinishReason.ERROR, f"engine error: {message}")
        for request in list(self._requests.values()):
            self._finish_request(request, FinishReason.CANCELLED)
        self._answer_queued(FinishReason.CANCELLED, "the engine stopped")
        self._maybe_snapshot(force=True)

    def _load(self) -> None:
        cfg = self.config
        loaded = load_model(cfg.model, cfg.quantized)
        shape = probe_kv_shape(loaded.model)
        num_blocks = blocks_for_budget(shape, cfg.block_size, cfg.kv_memory_mib)
        use_kernel = cfg.attention == "kernel" or (
            cfg.attention == "auto" and attention.kernel_available()
        )
        if loaded.model_type not in PROVEN_ARCHITECTURES:
            self._verify_architecture(loaded, shape)
        self.pool = KVPool(shape, num_blocks, cfg.block_size)
        self.alloc = BlockAllocator(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.alloc, cfg.max_batch, cfg.prefill_chunk)
        self.paged = PagedModel(loaded.model, self.pool, use_kernel=use_kernel)
        self.max_context = min(cfg.max_context or loaded.max_context, loaded.max_context)
        self.eos_ids = set(loaded.tokenizer.eos_token_ids)
        self._loaded = loaded
        self.model_info = ModelInfo(
            name=loaded.name,
            model_type=loaded.model_type,
            max_context=self.max_context,
            block_size=cfg.block_size,
            num_blocks=num_blocks,
            bytes_per_block=self.pool.bytes_per_block,
            paged=True,
            attention="metal-kernel" if use_kernel else "reference",
        )
        self._maybe_snapshot(force=True)

    def _verify_architecture(self, loaded: LoadedModel, shape) -> None:
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

    def _drain_after_failure(self) -> None:
        """After a failed load, answer every request with the load error until stopped."""
        self._answer_queued(FinishReason.ERROR, self.load_error, until_stop=True)

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
                for index in range(item.params.n):
                    item.handle._push(self._final_event(
                        item.request_id, item.session_id, index, reason, "",
                        self._usage(None, 0, 0), error=message,
                    ))

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
        request = Request(item.request_id, item.session_id, item.params, [], item.handle)
        self._known_sessions[item.session_id] = None
        try:
            prompt = (
                self._apply_template(item.messages)
                if item.messages is not None
                else item.prompt_tokens
            )
        except Exception as e:
            self._reject(request, f"the conversation could not be formatted for this model: {e}")
            return
        request.prompt = prompt
        limit = self.max_context
        if len(prompt) >= limit:
            self._reject(
                request,
                f"the prompt is {len(prompt)} tokens but the model's context limit is {limit}: "
                "shorten the conversation or start a new chat",
            )
            return
        vocab = self._loaded.tokenizer.vocab_size
        if any(t < 0 or t >= max(vocab, len(self._loaded.tokenizer)) for t in prompt):
            self._reject(request, "the prompt holds token ids outside the model's vocabulary")
            return
        for index in range(item.params.n):
            request.sequences.append(
                Sequence(
                    request=request,
                    index=index,
                    tokens=list(prompt),
                    num_prompt=len(prompt),
                    key=None if item.params.greedy else new_key(item.params.seed, index),
                    detokenizer=self._loaded.tokenizer.detokenizer,
                )
            )
        self._requests[request.request_id] = request
        self.scheduler.add(request.sequences[0])  # samples 1.. fork from it after the prompt

    def _reject(self, request: Request, message: str) -> None:
        for index in range(request.params.n):
            request.handle._push(self._final_event(
                request.request_id, request.session_id, index, FinishReason.ERROR, "",
                self._usage(request, 0, 0), error=message,
            ))

    def _cancel(self, item: _Cancel) -> None:
        if item.request_id is not None:
            request = self._requests.get(item.request_id)
            if request is not None:
                self._finish_request(request, FinishReason.CANCELLED)
            return
        for request in [r for r in self._requests.values() if r.session_id == item.session_id]:
            self._finish_request(request, FinishReason.CANCELLED)
        self._known_sessions.pop(item.session_id, None)
        self._session_rates.pop(item.session_id, None)

    def _apply_template(self, messages: list[dict], add_generation_prompt: bool = True):
        tokenizer = self._loaded.tokenizer
        if getattr(tokenizer, "chat_template", None):
            return list(tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt))
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return list(tokenizer.encode(text + ("\nassistant:" if add_generation_prompt else "")))

    # ---- one step ---------------------------------------------------------------------------

    def _step(self) -> None:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        for seq, message in plan.failed:
            self._finish(seq, FinishReason.ERROR, message)
        if not plan.works:
            return
        self.pool.copy_blocks(plan.copies)
        t_sched = time.perf_counter() - t0
        sampled = self._forward_and_sample(plan)
        t1 = time.perf_counter()
        self.scheduler.commit(plan)
        for seq, token in sampled:
            self._guard(seq, self._accept_token, seq, token)
        t2 = time.perf_counter()
        self._batch = len(plan.works)
        self._step_ms = _ema(self._step_ms, (t2 - t0) * 1000)
        self._sched_ms = _ema(self._sched_ms, (t_sched + t2 - t1) * 1000)

    def _forward_and_sample(self, plan: StepPlan) -> list[tuple[Sequence, int]]:
        """Run the batch; on failure, run each sequence alone to fail only the culprits."""
        try:
            return self._run_works(plan.works)
        except Exception as e:
            if len(plan.works) == 1:
                self._finish(plan.works[0].seq, FinishReason.ERROR, _describe(e))
                return []
            logger.warning("step failed (%s); isolating its %d sequences", e, len(plan.works))
        sampled = []
        for work in plan.works:
            try:
                sampled.extend(self._run_works([work]))
            except Exception as e:
                self._finish(work.seq, FinishReason.ERROR, _describe(e))
        return sampled

    def _run_works(self, works: list[ScheduledWork]) -> list[tuple[Sequence, int]]:
        batch = build_step_batch(
            [SequenceWork(w.tokens, w.start, w.seq.table.blocks, w.slots, w.want_logits)
             for w in works]
        )
        logits = self.paged.forward(batch)
        mx.eval(logits)  # a failing forward raises here, before any fork or sample
        rows: list[tuple[Sequence, mx.array]] = []
        for i, owner in enumerate(batch.logit_owners):
            seq = works[owner].seq
            for s in self._samples_from(seq):
                token = self._guard(s, self._sample, s, logits[i])
                if token is not None:
                    rows.append((s, token))
        mx.eval([t for _, t in rows])
        return [(s, t.item()) for s, t in rows]

    def _samples_from(self, seq: Sequence) -> list[Sequence]:
        """The sequences that draw from ``seq``'s logits: itself, plus its siblings the
        first time a request with n > 1 reaches them (they fork from it, sharing blocks)."""
        request = seq.request
        if request.forked or request.params.n == 1:
            return [seq]
        request.forked = True
        siblings = [seq]
        for sibling in request.sequences[1:]:
            if sibling.finished:
                continue
            sibling.tokens = list(seq.tokens)
            sibling.table = self.alloc.fork(seq.table)
            sibling.state = SequenceState.DECODING
            sibling.admitted_at = seq.admitted_at
            self.scheduler.add_running(sibling)
            siblings.append(sibling)
        return siblings

    def _sample(self, seq: Sequence, logits: mx.array) -> mx.array:
        if self.fault_injector is not None:
            self.fault_injector(seq)
        token, seq.key = sample_next(logits, seq.request.params, seq.tokens, seq.key)
        return token

    def _guard(self, seq: Sequence, fn, *args):
        """Run per-sequence work; an exception fails that sequence only."""
        try:
            return fn(*args)
        except Exception as e:
            logger.exception("request %s failed", seq.request.request_id)
            self._finish(seq, FinishReason.ERROR, _describe(e))
            return None

    # ---- output -----------------------------------------------------------------------------

    def _accept_token(self, seq: Sequence, token: int) -> None:
        if seq.finished:
            return
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.tokens.append(token)
        self._generated += 1
        self._rate.add(now, 1)
        self._session_rates.setdefault(seq.session_id, _Rate()).add(now, 1)
        params = seq.request.params
        if token in self.eos_ids:
            seq.detokenizer.finalize()
            self._emit_and_finish(seq, seq.detokenizer.text, [token], FinishReason.STOP)
            return
        seq.detokenizer.add_token(token)
        text = seq.detokenizer.text
        for stop in params.stop:
            at = text.find(stop, max(0, seq.emitted_chars - len(stop)))
            if at >= 0:
                self._emit_and_finish(seq, text[:at], [token], FinishReason.STOP)
                return
        if seq.num_generated >= params.max_tokens or len(seq.tokens) >= self.max_context:
            seq.detokenizer.finalize()
            self._emit_and_finish(seq, seq.detokenizer.text, [token], FinishReason.LENGTH)
            return
        hold = max((len(s) - 1 for s in params.stop), default=0)
        self._emit(seq, text[: len(text) - hold] if hold else text, [token])

    def _emit(self, seq: Sequence, text: str, token_ids: list[int]) -> None:
        delta = text[seq.emitted_chars :]
        seq.emitted_chars = max(seq.emitted_chars, len(text))
        seq.text = text
        seq.request.handle._push(
            TokenEvent(seq.request.request_id, seq.session_id, seq.index, delta, tuple(token_ids))
        )

    def _emit_and_finish(self, seq, text: str, token_ids: list[int], reason: FinishReason):
        self._emit(seq, text, token_ids)
        seq.text = text
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.finished:
            return
        self.scheduler.remove(seq)
        seq.state = SequenceState.FINISHED
        seq.finish_reason = reason
        request = seq.request
        request.handle._push(self._final_event(
            request.request_id, seq.session_id, seq.index, reason, seq.text,
            self._usage(request, seq.num_generated, seq), error=error,
        ))
        if seq.index == 0 and not request.forked:
            for sibling in request.sequences[1:]:  # they would have forked from this one
                self._finish(sibling, reason, error)
        if request.finished:
            self._requests.pop(request.request_id, None)

    def _finish_request(
        self, request: Request, reason: FinishReason, error: str | None = None
    ) -> None:
        for seq in request.sequences:
            self._finish(seq, reason, error)
        self._requests.pop(request.request_id, None)

    def _final_event(self, request_id, session_id, index, reason, text, usage, error=None):
        return FinalEvent(request_id, session_id, index, reason, text, usage, error)

    def _usage(self, request: Request | None, generated: int, seq: Sequence | None = None):
        now = time.perf_counter()
        arrival = request.arrival if request is not None else now
        first = seq.first_token_time if isinstance(seq, Sequence) else None
        decode_s = now - first if first is not None else 0.0
        return Usage(
            prompt_tokens=len(request.prompt) if request is not None else 0,
            cached_prompt_tokens=request.cached_prompt_tokens if request is not None else 0,
            generated_tokens=generated,
            time_to_first_token_s=(first - arrival) if first is not None else None,
            total_time_s=now - arrival,
            decode_tokens_per_s=(generated - 1) / decode_s if generated > 1 and decode_s else 0.0,
        )

    # ---- snapshots --------------------------------------------------------------------------

    def _maybe_snapshot(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_snapshot < SNAPSHOT_INTERVAL_S:
            return
        self._last_snapshot = now
        self._snapshot = self._build_snapshot(now)

    def _build_snapshot(self, now: float) -> PoolSnapshot:
        owners, refcounts, fills, cached, tokens = self.alloc.block_state()
        sessions: dict[str, dict] = {sid: _new_session() for sid in self._known_sessions}
        bs = self.alloc.block_size
        for request in self._requests.values():
            stats = sessions.setdefault(request.session_id, _new_session())
            stats["requests"] += 1
            for seq in request.sequences:
                stats["states"].add(seq.state)
                if seq.table is not None:
                    stats["blocks"].update(seq.table.blocks)
                    stats["tokens"] += seq.table.num_tokens
        result = {}
        for sid, s in sessions.items():
            held = s["blocks"]
            result[sid] = SessionStats(
                session_id=sid,
                state=_session_state(s["states"]),
                blocks_held=len(held),
                blocks_shared=sum(1 for b in held if refcounts[b] > 1),
                tokens_in_context=s["tokens"],
                wasted_slots=sum(bs - fills[b] for b in held),
                tokens_per_s=self._session_rates[sid].per_second(now)
                if sid in self._session_rates else 0.0,
                requests=s["requests"],
            )
        counters = Counters(
            steps=self.scheduler.steps,
            batch_size=self._batch if self.scheduler.has_work else 0,
            step_time_ms=self._step_ms,
            schedule_time_ms=self._sched_ms,
            preemptions=self.scheduler.preemptions,
            prefix_cache_hits=self.alloc.prefix_hits,
            prefix_cache_queries=self.alloc.prefix_queries,
            tokens_per_s=self._rate.per_second(now),
            generated_tokens=self._generated,
        )
        return PoolSnapshot(
            time=time.time(),
            block_size=bs,
            num_blocks=self.alloc.num_blocks,
            bytes_per_block=self.pool.bytes_per_block,
            owners=owners,
            refcounts=refcounts,
            fills=fills,
            cached=cached,
            block_tokens=tokens,
            sessions=result,
            counters=counters,
            model_name=self.model_info.name if self.model_info else "",
            paged=True,
        )


_STATE_ORDER = (
    SequenceState.DECODING,
    SequenceState.PREFILLING,
    SequenceState.PREEMPTED,
    SequenceState.WAITING,
)


def _new_session() -> dict:
    return {"states": set(), "blocks": set(), "tokens": 0, "requests": 0}


def _session_state(states: set[SequenceState]) -> SequenceState:
    for state in _STATE_ORDER:
        if state in states:
            return state
    return SequenceState.FINISHED


def _ema(previous: float, value: float, alpha: float = 0.2) -> float:
    return value if previous == 0.0 else previous + alpha * (value - previous)


def _describe(e: Exception) -> str:
    return f"generation failed: {type(e).__name__}: {e}"
