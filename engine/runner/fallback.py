"""The fallback engine: a model that fails the paged check runs on mlx-lm's BatchGenerator.

Some architectures cannot run on the paged pool (their attention bypasses
``scaled_dot_product_attention``, as gemma2's soft-capped logits do, or they keep a recurrent
state): refusing them outright would leave the user with no way to chat with a model that
mlx-lm itself runs fine. So they run here, on ``mlx_lm.generate.BatchGenerator`` and its
own left-padded ``BatchKVCache``: still continuous batching across every chat, without
paging, prefix sharing or copy-on-write (docs/ARCHITECTURE.md §3.11).

Only the two pieces that touch the model change: :class:`FallbackScheduler` stands in for
the paged scheduler (queue bookkeeping, which ``Output`` and the engine loop call) and
:class:`FallbackRunner` for the step runner. Admission, token acceptance (EOS, stop strings,
``max_tokens``), events, cancellation and the snapshot's sessions are the paged engine's own
code, so both paths answer the public API identically. The BatchGenerator is told neither
EOS nor stop strings: ``Output`` decides when a reply ends, and the runner takes the ended
replies out of the batch once the step is over (:meth:`FallbackRunner.release_finished`), as
the paged runner does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.events import FinishReason, SequenceState
from engine.runner.output import Output
from engine.runner.sampling import SamplingRow, sample_rows
from engine.runner.telemetry import StepTimes, Telemetry
from engine.sched.sequence import Sequence

logger = logging.getLogger(__name__)

#: What ModelInfo.attention says for a model on this path.
ATTENTION_NAME = "mlx-lm"


class NoPool:
    """The allocator the snapshot reads, for a model without a block pool: no blocks."""

    num_blocks = 0
    prefix_hits = 0
    prefix_queries = 0

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def block_state(self) -> tuple[tuple, tuple, tuple, tuple, tuple]:
        return (), (), (), (), ()

    def owner_usage(self, owner: str) -> tuple[int, int, int]:
        return 0, 0, 0


class FallbackScheduler:
    """Which sequences wait for the BatchGenerator and which run in it (by its uid).

    Has the part of the paged scheduler's interface that the engine loop and the runner use
    (add, remove, has_work, steps, preemptions). The generator itself belongs to the runner;
    a removed sequence is taken out of it at once (the runner removes the sequences the
    output ended on the engine thread, after a step or a round of commands)."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.waiting: deque[Sequence] = deque()
        self.by_uid: dict[int, Sequence] = {}
        self.uid_of: dict[int, int] = {}  # seq_id -> uid
        self.generator: Any = None  # set by the runner
        self.steps = 0
        self.preemptions = 0  # nothing is ever preempted: the cache grows as it must

    def add(self, seq: Sequence) -> None:
        """Queue a request's sequences: every sample is its own row (mlx-lm's cache cannot
        fork, so n > 1 prefills the prompt once per sample)."""
        request = seq.request
        request.forked = True  # Output must not finish siblings for a first sample
        for sibling in request.sequences:
            if not sibling.finished:
                sibling.state = SequenceState.WAITING
                self.waiting.append(sibling)

    def remove(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        uid = self.uid_of.pop(seq.seq_id, None)
        if uid is not None:
            self.by_uid.pop(uid, None)
            if self.generator is not None:
                self.generator.remove([uid])

    def set_priority(self, session_id: str, priority) -> None:
        """Recorded on the requests (the snapshot shows it); mlx-lm's generator serves its
        rows in arrival order, so the fallback does not reorder by it."""
        for seq in [*self.waiting, *self.by_uid.values()]:
            if seq.session_id == session_id:
                seq.request.priority = priority

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.by_uid)

    @property
    def running(self) -> list[Sequence]:
        return list(self.by_uid.values())


def _sampler(seq: Sequence):
    """A one-row sampler for a sampled (not greedy) sequence: the paged engine's own
    filters and its per-request PRNG key, so seeds mean the same on both paths. The
    repetition penalty is mlx-lm's logits processor (it sees the logits first)."""
    params = dataclasses.replace(seq.request.params, repetition_penalty=1.0)

    def sample(logprobs: mx.array) -> mx.array:
        tokens, keys = sample_rows(logprobs, [SamplingRow(params, (), seq.key)])
        seq.key = keys[0]  # kept on the sequence: a row queued again continues its chain
        return tokens

    return sample


class FallbackRunner:
    """One engine step on the BatchGenerator: a prefill chunk and/or one decode token for
    every running row, each token handed to ``Output`` as the paged step does."""

    def __init__(self, model: nn.Module, scheduler: FallbackScheduler, output: Output,
                 telemetry: Telemetry, max_context: int, prefill_chunk: int) -> None:
        self.model = model
        self.scheduler = scheduler
        self.output = output
        self.telemetry = telemetry
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        #: Rows per batch; 1 once mlx-lm failed to batch this model (see step()).
        self.max_rows = scheduler.max_batch
        self._new_generator()

    def _new_generator(self) -> None:
        from mlx_lm.generate import BatchGenerator

        max_batch = self.max_rows
        self.generator = BatchGenerator(
            self.model,
            completion_batch_size=max_batch,
            prefill_batch_size=min(8, max_batch),
            prefill_step_size=self.prefill_chunk,
            # A stream of the engine thread: mlx-lm's module-level stream was made by
            # whichever thread imported it.
            stream=mx.new_stream(mx.default_device()),
        )
        self.scheduler.generator = self.generator

    def _insert_waiting(self) -> None:
        from mlx_lm.generate import StopSequences
        from mlx_lm.sample_utils import make_logits_processors

        sched = self.scheduler
        while sched.waiting:
            seq = sched.waiting.popleft()
            params = seq.request.params
            room = self.max_context - len(seq.tokens)
            processors = (make_logits_processors(
                repetition_penalty=params.repetition_penalty,
                repetition_context_size=params.repetition_context_size,
            ) if params.repetition_penalty != 1.0 else [])
            (uid,) = self.generator.insert(
                [list(seq.tokens)],
                max_tokens=[max(1, min(params.max_tokens - seq.num_generated, room))],
                samplers=[None if params.greedy else _sampler(seq)],
                logits_processors=[processors],
                stop_sequences=[StopSequences(None)],
            )
            seq.state = SequenceState.PREFILLING
            sched.by_uid[uid] = seq
            sched.uid_of[seq.seq_id] = uid

    def step(self) -> None:
        start = time.perf_counter()
        sched = self.scheduler
        try:
            self._insert_waiting()
            _, responses = self.generator.next()
        except Exception as e:  # the batch is in an unknown state: start a new generator
            rows = list(sched.by_uid.values())
            self.generator.close()
            if len(rows) > 1 and self.max_rows > 1:
                # Some mlx-lm models fail only when batched (gemma2's mask does not broadcast
                # over a ragged batch): serve one row at a time from now on. The rows are
                # queued again with their tokens so far, nothing emitted is lost.
                logger.warning("mlx-lm cannot batch this model (%s: %s); serving one chat "
                               "at a time", type(e).__name__, e)
                self.max_rows = 1
                sched.by_uid.clear()
                sched.uid_of.clear()
                for seq in reversed(rows):
                    seq.state = SequenceState.WAITING
                    sched.waiting.appendleft(seq)
                self._new_generator()
                return
            logger.exception("fallback step failed")
            message = f"generation failed: {type(e).__name__}: {e}"
            for seq in rows + list(sched.waiting):
                self.output.finish(seq, FinishReason.ERROR, message)
            self.release_finished()  # out of the old generator, before the new one
            self._new_generator()
            return
        forward = time.perf_counter() - start
        for r in responses:
            seq = sched.by_uid.get(r.uid)
            if seq is None:  # cancelled while its token was in flight
                continue
            seq.state = SequenceState.DECODING
            try:
                self.output.accept_token(seq, int(r.token))
                if r.finish_reason is not None and not seq.finished:
                    # The generator's own budget ran out first: the context limit.
                    self.output.finish(seq, FinishReason.LENGTH)
            except Exception as e:
                logger.exception("fallback token handling failed")
                self.output.finish(seq, FinishReason.ERROR,
                                   f"generation failed: {type(e).__name__}: {e}")
        self.release_finished()
        sched.steps += 1
        total = time.perf_counter() - start
        self.telemetry.step(len(sched.by_uid), total,
                            StepTimes(forward=forward, bookkeeping=total - forward))

    def release_finished(self) -> None:
        """Take the replies the output ended out of the queue and the generator."""
        for seq in self.output.take_finished():
            self.scheduler.remove(seq)

    def discard_inflight(self) -> None:
        """At stop: give back what the generator holds (its wired-memory limit too)."""
        self.generator.close()
