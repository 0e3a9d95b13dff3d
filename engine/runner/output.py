"""From sampled tokens to events: acceptance, EOS, stop strings, max_tokens, finishing, usage.

Every sequence ends here exactly once (``finish`` is idempotent), with one final event after
its last token event. The output never calls the scheduler: an ended sequence is handed
back in ``finished``, and the runner gives its blocks back in one place once the step (or
the engine's round of commands) is over (``StepRunner.release_finished``): nothing else in
the step frees or takes a block in between, so what the pool looks like after the step is
the same, and the scheduler is called in the step only to plan it, commit it and resolve
its tokens.
"""

from __future__ import annotations

import time

from engine.events import FinalEvent, FinishReason, SequenceState, TokenEvent, TokenLogprob, Usage
from engine.handle import RequestHandle
from engine.runner.telemetry import Telemetry
from engine.sched.sequence import Request, Sequence


class Output:
    """The live requests, and the rules that turn their tokens into events."""

    def __init__(self, telemetry: Telemetry, eos_ids: set[int], max_context: int) -> None:
        self.telemetry = telemetry
        self.eos_ids = eos_ids
        self.max_context = max_context
        self.requests: dict[str, Request] = {}
        #: sequences ended since the runner last took them: they still hold their blocks
        self.finished: list[Sequence] = []

    def accept_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None
                     ) -> None:
        """Append a sampled token, then emit it or end the sequence (EOS, stop, length);
        ``logprob``: its log-probability, when the request asked for them."""
        if seq.finished:
            return
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.tokens.append(token)
        self.telemetry.token(seq.session_id, now)
        params = seq.request.params
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            self.finish(seq, FinishReason.ERROR,
                        f"the reply left its constraint: {seq.matcher.get_error()}")
            return
        if token in self.eos_ids:  # not part of the reply's text: no log-probability either
            seq.detokenizer.finalize()
            self._emit_and_finish(seq, seq.detokenizer.text, [token], FinishReason.STOP)
            return
        seq.detokenizer.add_token(token)
        text = seq.detokenizer.text
        for stop in params.stop:
            at = text.find(stop, max(0, seq.emitted_chars - len(stop)))
            if at >= 0:
                self._emit_and_finish(seq, text[:at], [token], FinishReason.STOP, logprob)
                return
        if seq.matcher is not None and seq.matcher.is_stopped():  # the grammar is complete
            seq.detokenizer.finalize()
            self._emit_and_finish(seq, seq.detokenizer.text, [token], FinishReason.STOP, logprob)
            return
        if seq.num_generated >= params.max_tokens or len(seq.tokens) >= self.max_context:
            seq.detokenizer.finalize()
            self._emit_and_finish(seq, seq.detokenizer.text, [token], FinishReason.LENGTH, logprob)
            return
        # Hold back what could still become a stop string, so it is never shown.
        hold = max((len(s) - 1 for s in params.stop), default=0)
        self._emit(seq, text[: len(text) - hold] if hold else text, [token], logprob)

    def end_at_pool_limit(self, seq: Sequence, capacity_tokens: int) -> None:
        """End a reply that outgrew the whole KV pool: ``length``, with all its text (what
        a stop string held back included) and a detail saying why. A beam search ends with
        its hypotheses so far, the live beams counted as finished where they are."""
        if seq.finished:
            return
        detail = (f"the reply filled the KV pool ({capacity_tokens} tokens with the prompt): "
                  "raise the KV memory budget for longer replies")
        group = seq.request.beams
        if group is not None:
            group.finalize_now()
            self.finish_beam_search(seq.request, detail)
            return
        seq.detokenizer.finalize()
        text = seq.detokenizer.text
        if len(text) > seq.emitted_chars:
            self._emit(seq, text, [])
        seq.text = text
        self.finish(seq, FinishReason.LENGTH, detail=detail)

    def finish_beam_search(self, request: Request, detail: str | None = None) -> None:
        """End a beam search with its ``n`` best hypotheses: for each, one token event with
        the whole reply (beam search streams nothing before: every live beam may still be
        pruned) and its final event with the hypothesis's score. Every beam is handed back
        for its blocks to be freed."""
        group = request.beams
        if not self._end_beams(request):
            return
        decoder = request.sequences[0].detokenizer
        first = request.sequences[0]
        first.first_token_time = group.first_step_time
        for index, hypothesis in enumerate(group.best()):
            decoder.reset()
            for token in hypothesis.tokens:
                if token not in self.eos_ids:
                    decoder.add_token(token)
            decoder.finalize()
            text = decoder.text
            request.handle._push(TokenEvent(request.request_id, request.session_id, index,
                                            text, hypothesis.tokens))
            reason = FinishReason.STOP if hypothesis.ended else FinishReason.LENGTH
            request.handle._push(FinalEvent(
                request.request_id, request.session_id, index, reason, text,
                usage(request, len(hypothesis.tokens), first), None, detail,
                hypothesis.score))
        self.requests.pop(request.request_id, None)

    def _end_beams(self, request: Request) -> bool:
        """Mark every beam of ``request`` finished and hand them back (their blocks go after
        the step); False when the search had already ended."""
        if all(s.finished for s in request.sequences):
            return False
        for seq in request.sequences:
            if not seq.finished:
                seq.state = SequenceState.FINISHED
                self.finished.append(seq)
        return True

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None,
               detail: str | None = None) -> None:
        """End one sequence (no-op if it has ended): send its final event, and hand it back
        in ``finished`` for the runner to free its blocks."""
        if seq.finished:
            return
        request = seq.request
        if request.beams is not None:  # a beam ends the whole search: one final per reply
            self._end_beams(request)
            refuse(request.handle, request.params.n, reason, error, request)
            self.requests.pop(request.request_id, None)
            return
        self.finished.append(seq)
        seq.state = SequenceState.FINISHED
        seq.finish_reason = reason
        request.handle._push(FinalEvent(
            request.request_id, seq.session_id, seq.index, reason, seq.text,
            usage(request, seq.num_generated, seq), error, detail,
        ))
        if seq.index == 0 and not request.forked:
            for sibling in request.sequences[1:]:  # they would have forked from this one
                self.finish(sibling, reason, error)
        if request.finished:
            self.requests.pop(request.request_id, None)

    def take_finished(self) -> list[Sequence]:
        """The sequences ended since the last call, in the order they ended."""
        finished, self.finished = self.finished, []
        return finished

    def finish_request(self, request: Request, reason: FinishReason,
                       error: str | None = None) -> None:
        for seq in request.sequences:
            self.finish(seq, reason, error)
        self.requests.pop(request.request_id, None)

    def finish_all(self, reason: FinishReason, error: str | None = None) -> None:
        for request in list(self.requests.values()):
            self.finish_request(request, reason, error)

    def _emit(self, seq: Sequence, text: str, token_ids: list[int],
              logprob: TokenLogprob | None = None) -> None:
        delta = text[seq.emitted_chars :]
        seq.emitted_chars = max(seq.emitted_chars, len(text))
        seq.text = text
        seq.request.handle._push(
            TokenEvent(seq.request.request_id, seq.session_id, seq.index, delta, tuple(token_ids),
                       (logprob,) if logprob is not None else None)
        )

    def _emit_and_finish(self, seq: Sequence, text: str, token_ids: list[int],
                         reason: FinishReason, logprob: TokenLogprob | None = None) -> None:
        self._emit(seq, text, token_ids, logprob)
        seq.text = text
        self.finish(seq, reason)


def refuse(handle: RequestHandle, n: int, reason: FinishReason, message: str | None,
           request: Request | None = None) -> None:
    """End every sample of a request with an empty reply: one that never ran (rejected, or
    the engine cannot serve), or a beam search cancelled or failed before its end."""
    spent = time.perf_counter() - request.arrival if request is not None else 0.0
    prompt = len(request.prompt) if request is not None else 0
    empty = Usage(prompt, 0, 0, None, spent, 0.0)
    for index in range(n):
        handle._push(FinalEvent(handle.request_id, handle.session_id, index, reason, "", empty,
                                message))


def usage(request: Request, generated: int, seq: Sequence) -> Usage:
    now = time.perf_counter()
    first = seq.first_token_time
    decode_s = now - first if first is not None else 0.0
    return Usage(
        prompt_tokens=len(request.prompt),
        cached_prompt_tokens=request.cached_prompt_tokens,
        generated_tokens=generated,
        time_to_first_token_s=(first - request.arrival) if first is not None else None,
        total_time_s=now - request.arrival,
        decode_tokens_per_s=(generated - 1) / decode_s if generated > 1 and decode_s else 0.0,
        disk_prompt_tokens=min(request.disk_prompt_tokens, request.cached_prompt_tokens),
    )
