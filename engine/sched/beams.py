"""Beam search's bookkeeping: which continuations go on, which hypotheses are finished, when
the search ends (docs/ARCHITECTURE.md §3.12).

A beam group is one request whose ``beam_width`` live beams are sequences of that request,
sharing blocks through the allocator (the scheduler forks and prunes them:
``Scheduler.advance_beams``). Each beam reports the best ``candidates_per_beam`` next tokens
of its row with their log-probabilities (computed on the device, engine/runner/beams.py);
once every live beam has reported for its current length, :meth:`BeamGroup.select` ranks
the continuations by summed log-probability and decides, exactly as Hugging Face's
``_beam_search`` (transformers 5.x) does:

* the best ``candidates_per_beam`` continuations of all beams are kept, best first;
* those among the first ``beam_width`` that end (the end-of-sequence token, or
  ``max_tokens`` / the context limit reached) become hypotheses, scored
  ``sum of log-probabilities / generated length ** length_penalty`` (the end token
  counts in both); the best ``beam_width`` hypotheses are kept;
* the best ``beam_width`` continuations that do not end are the next live beams;
* the search stops at the limit, or when the best live beam cannot beat the worst kept
  hypothesis (``early_stopping`` False: judged at the present length; "never": at the
  longest length when ``length_penalty`` > 0), or (``early_stopping`` True) as soon as
  ``beam_width`` hypotheses are kept.

Pure bookkeeping on host floats (at most ``beam_width * candidates_per_beam`` candidates a
step): no MLX, no allocator.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sched.sequence import Request
    from engine.sched.sequence import Sequence as Seq


def candidates_per_beam(beam_width: int, num_eos: int) -> int:
    """How many continuations each beam reports, and how many the group keeps a step: HF's
    ``max(2, 1 + number of end tokens) * beam_width``, enough that ``beam_width`` of them
    go on even when every beam's best continuations end."""
    return max(2, 1 + num_eos) * beam_width


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its generated tokens (the end token included when it ended on one),
    their summed log-probability and its length-penalised score."""

    score: float
    logprob: float
    tokens: tuple[int, ...]
    ended: bool  # on the end-of-sequence token (else at max_tokens or the context limit)


@dataclass(frozen=True)
class Continuation:
    """One kept continuation: ``parent`` (a live beam) extended by ``token``."""

    parent: Seq
    token: int
    logprob: float  # summed over the generated tokens, this one included


@dataclass(frozen=True)
class BeamStep:
    """What one step of the search decided: the continuations that go on (best first, one
    per next live beam), and whether the search has ended."""

    continuations: list[Continuation]
    done: bool


@dataclass(eq=False)
class BeamGroup:
    """One request's beam search: its live beams, their scores, their reports this step and
    the hypotheses kept so far."""

    request: Request
    #: The live beams, best first (one sequence of the request each; before the first step,
    #: the prompt's sequence alone).
    live: list[Seq] = field(default_factory=list)
    #: Summed log-probability of each live beam's generated tokens, by seq_id.
    scores: dict[int, float] = field(default_factory=dict)
    #: Each live beam's report for its present length: (length, [(token, logprob)...]).
    reports: dict[int, tuple[int, list[tuple[int, float]]]] = field(default_factory=dict)
    #: The kept hypotheses, best first (at most beam_width).
    finished: list[Hypothesis] = field(default_factory=list)
    #: False once the best live beam can no longer beat the worst kept hypothesis.
    improvable: bool = True
    #: perf_counter time of the first step (the first "token" of the request).
    first_step_time: float | None = None

    @property
    def width(self) -> int:
        return self.request.params.beam_width

    def start(self, seq: Seq) -> None:
        """The search begins from ``seq``, the prompt's sequence."""
        self.live = [seq]
        self.scores = {seq.seq_id: 0.0}

    def report(self, seq: Seq, candidates: list[tuple[int, float]]) -> bool:
        """``seq``'s best next tokens and their log-probabilities, best first; True when
        every live beam has reported for its present length (the group can step)."""
        self.reports[seq.seq_id] = (seq.length, candidates)
        return self.ready

    @property
    def ready(self) -> bool:
        return all((r := self.reports.get(s.seq_id)) is not None and r[0] == s.length
                   for s in self.live)

    def preempted(self) -> None:
        """The group's beams lost their blocks: each reports again once recomputed."""
        self.reports.clear()

    def select(self, eos_ids: Iterable[int], max_context: int) -> BeamStep:
        """Rank every live beam's continuations and decide (see the module's docstring)."""
        params = self.request.params
        eos = set(eos_ids)
        k = params.beam_width
        keep = candidates_per_beam(k, len(eos))
        ranked: list[tuple[float, int, Seq, int]] = []
        for rank, beam in enumerate(self.live):
            base = self.scores[beam.seq_id]
            ranked.extend((base + lp, rank, beam, token)
                           for token, lp in self.reports[beam.seq_id][1][:keep])
        ranked.sort(key=lambda c: (-c[0], c[1]))  # stable: ties keep beam rank, then token rank
        ranked = ranked[:keep]
        first = self.live[0]
        generated = first.num_generated + 1
        limit = min(params.max_tokens, max_context - first.num_prompt)
        at_limit = generated >= limit
        new: list[Hypothesis] = []
        for logprob, _, beam, token in ranked[:k]:
            if at_limit or token in eos:
                tokens = (*beam.tokens[beam.num_prompt:], token)
                new.append(Hypothesis(logprob / generated ** params.length_penalty, logprob,
                                      tokens, token in eos))
        if new:
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:k]
        going_on = [Continuation(beam, token, logprob) for logprob, _, beam, token in ranked
                    if not (at_limit or token in eos)][:k]
        if at_limit or len(going_on) < k:
            return BeamStep([], True)
        longest = (limit if params.early_stopping == "never" and params.length_penalty > 0
                   else generated)
        best_possible = going_on[0].logprob / longest ** params.length_penalty
        if len(self.finished) == k:
            self.improvable = self.improvable and best_possible > self.finished[-1].score
        done = not self.improvable or (params.early_stopping is True
                                       and len(self.finished) == k)
        return BeamStep([] if done else going_on, done)

    def advanced(self, beams: Sequence[tuple[Seq, float]]) -> None:
        """The scheduler placed the continuations: ``beams`` are the new live beams, best
        first, with their summed log-probabilities."""
        self.live = [seq for seq, _ in beams]
        self.scores = {seq.seq_id: score for seq, score in beams}
        self.reports.clear()

    def finalize_now(self) -> None:
        """End the search where it is (the pool cannot hold it any longer): the live beams
        count as hypotheses at their present length, as at ``max_tokens``."""
        params = self.request.params
        new = []
        for beam in self.live:
            generated = beam.num_generated
            if generated:
                logprob = self.scores[beam.seq_id]
                new.append(Hypothesis(logprob / generated ** params.length_penalty, logprob,
                                      tuple(beam.tokens[beam.num_prompt:]), False))
        self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:params.beam_width]

    def best(self) -> list[Hypothesis]:
        """The ``n`` best hypotheses, best first (the request's replies)."""
        return self.finished[: self.request.params.n]
