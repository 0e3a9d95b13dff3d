"""Speculative decoding's drafts: what a decoding sequence proposes to verify in its next
step, and how many tokens it is worth proposing (docs/ARCHITECTURE.md §3.13).

No draft model: the drafts are tokens the engine already has.

* **Prompt lookup**: the longest suffix n-gram of the sequence (``MAX_NGRAM`` down to 1
  tokens) found earlier in its own context (prompt and reply); the tokens that followed it
  there are the drafts. Editing text it was given ("repeat this file with one change")
  makes long runs of them right.
* **Siblings**: sequences with the same prompt (the samples of an n > 1 request, or the
  same prompt sent in several chats: regenerate, send to all) look the same n-gram up in
  each other's tokens; a sibling's reply is the best guess of this one's.
* **Earlier replies**: a finished reply stays a sibling for later requests with the same
  prompt (the latest ``KEPT_REPLIES`` of the latest ``KEPT_PROMPTS`` prompts, their
  indexes built on first use). Regenerate is the case: the reply being replaced was
  sampled from the very distribution the new ones are, and, unlike siblings decoding in
  lockstep, it is already whole. An incognito chat's replies are never kept, and its
  sequences are siblings only of their own request's samples.

Each sequence keeps an :class:`NgramIndex` (n-gram -> where its latest earlier occurrence
ended), updated incrementally as tokens are accepted: a lookup is a few dict probes, never a
rescan.

**Adaptive length.** A draft of ``k`` tokens costs the step ``k`` more rows; it pays when
the tokens it is expected to add beat what that compute would give the batch otherwise.
With a per-token acceptance ``a`` (the sequence's recent rate, decayed), the j-th draft
adds ``a**j`` expected tokens; a row costs ``c`` seconds (measured: the steps with drafts
against those without, medians of the last 16 of each, :class:`StepCost`); the step makes
``N / T`` tokens per second (N decode rows in T seconds). So the j-th draft is worth it
while ``a**j > c * N / T``, and ``k`` is the largest such j.

At ``k`` = 0 the sequence stops drafting and *probes*, to notice when its text turns
repetitive: once ``PROBE_EVERY`` tokens have passed since its last draft, and again at once
after a step that kept several drafts, all of them. A probe verifies one draft, or the whole
continuation when the lookup matched a full ``MAX_NGRAM`` suffix. Overlapped, a one-draft
probe carries the lost overlap as one row's price and teaches the acceptance one token at a
time: a regenerated greedy reply stayed priced out on a GPU that way. The probe's clock
counts the sequence's tokens, not the steps that consulted the speculator: an overlapped
step never consults it for a sequence whose newest token is still on the device, so a clock
of consultations stopped for good once a sequence stopped drafting there.

**The host token's price.** Overlapped, a step launched while the previous one runs cannot
draft: its drafts follow a token still on the device. So a sequence that may draft asks for
its newest token on the host (:meth:`Speculator.wants_host_step`), and that step gives up
the overlap for the whole batch. A lookup that finds no draft backs the asking off: after
``m`` misses in a row the sequence asks again only ``2**(m-1)`` tokens later (at most
``PROBE_EVERY``), so a chat whose text never repeats runs overlapped almost always instead of
synchronously every step. A synchronous engine (the CPU) is asked every step anyway and
looks up every step: the lookup is a few dict probes.

**The batch decides, overlapped** (:meth:`Speculator.wants_host_step`, what the step runner
asks). The lost overlap is one price for the whole step, a *switch*, not a price per draft
row: priced per row, it was split among however many drafts a step carried, and each row
probed on its own clock (8 chats: up to 8 synchronous steps in 16). On the H100 drafting
forced on lost on every sampled workload (one chat 0.92x, 8 chats 0.77x); this rule did
not measurably change that (bench/results/speculative_gpu.md: the synchronous steps it
removes are not the main cost there), which is why drafting stays off by default where
steps overlap. So, overlapped, a step gives its overlap up only when the expected kept
tokens of the rows that would draft, at a step's share ``T / N`` each, pay for the switch
``S`` (``StepCost.switch_s``: a drafting step's time over a plain one, less its rows) and
their rows; probes, and a new sequence's first look, wait for the batch's *beat* (every
``PROBE_EVERY`` launches), so one synchronous step serves every row whose probe is due. A
draft row itself is priced at ``PRIOR_ROW_SHARE`` of a step there (a GPU's step is bound by
its launches, not by a few more rows), so a row among ``N`` drafts while ``a**j``
exceeds ``PRIOR_ROW_SHARE * N``. A step that kept several drafts, all of them, still
probes again at once (a copy in progress).

Pure bookkeeping (no MLX): the scheduler's draft slots ask :meth:`Speculator.propose`
while planning (engine/sched/draft_slots.py), the step runner reports what was accepted
(engine/runner/drafting.py) and how long steps took (engine/runner/step.py).
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass

from engine.sched.sequence import Sequence

#: The longest and shortest suffix n-grams looked up (longest first).
MAX_NGRAM = 4
MIN_NGRAM = 1
#: Most drafts a sequence verifies in one step.
MAX_DRAFT = 8
#: A sequence that stopped drafting tries one draft after this many of its tokens; also the
#: longest a sequence whose lookups miss waits before asking for its token on the host again.
PROBE_EVERY = 16
#: Weight kept by older acceptance observations at each new one.
ACCEPT_DECAY = 0.8
#: Finished replies kept as drafts for later requests with the same prompt: the latest
#: ``KEPT_REPLIES`` of each of the latest ``KEPT_PROMPTS`` prompts, if at least
#: ``MIN_KEPT_REPLY`` tokens long (tokens only; an index is built when a request uses it).
KEPT_PROMPTS = 32
KEPT_REPLIES = 4
MIN_KEPT_REPLY = 8
#: Before any step with drafts is measured, a draft row is assumed to cost this share of a
#: decode step (CPU, default model: a 9-token verify costs about 1.3 decode steps).
PRIOR_ROW_SHARE = 0.05


class NgramIndex:
    """Where each n-gram of a token list (n in ``MIN_NGRAM..MAX_NGRAM``) last occurred with
    a token after it: n-gram -> the index of that next token."""

    def __init__(self) -> None:
        self.next_of: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before tokens[indexed] are in the index

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams that gained a following token since the last update."""
        next_of = self.next_of
        for end in range(max(self.indexed, 1), len(tokens)):  # tokens[end] follows
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end - n < 0:
                    break
                next_of[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def match(self, suffix: list[int]) -> tuple[int, int]:
        """(n, next index) for the longest n-gram ending ``suffix`` that occurred before;
        (0, -1) when none did."""
        for n in range(min(MAX_NGRAM, len(suffix)), MIN_NGRAM - 1, -1):
            at = self.next_of.get(tuple(suffix[len(suffix) - n:]))
            if at is not None:
                return n, at
        return 0, -1


@dataclass
class DraftState:
    """One sequence's drafting: its index, its recent acceptance, its probing clock."""

    index: NgramIndex
    prompt_key: int
    #: decayed accepted drafts, and accepted drafts + rejections: a prior of one in three,
    #: which a lone chat drafts on (its threshold is near 0.2 on the CPU) but a row among
    #: others does not (near 0.45 with three rows) until a probe is accepted: measured, the
    #: prior of one in two had every reply of a sampled regenerate x3 draft at its start,
    #: which cost 4% of its time for almost nothing kept
    accepted: float = 1.0
    trials: float = 3.0
    last_try: int = 0  # the sequence's generated tokens when it last drafted (or probed)
    misses: int = 0  # lookups in a row that found no draft
    next_look: int = 0  # generated tokens before its token is wanted on the host again
    #: its last step verified several drafts and kept them all: it probes again at once
    kept_all: bool = False

    def probe_due(self, num_generated: int) -> bool:
        """Whether a sequence priced out of drafting probes at ``num_generated`` tokens:
        ``PROBE_EVERY`` tokens after it last drafted, or at once after a step that kept
        several drafts, all of them (a run of its earlier reply is being copied: each such
        step is worth many tokens, whatever the price the rule puts on one row)."""
        return self.kept_all or num_generated - self.last_try >= PROBE_EVERY

    def missed(self, num_generated: int) -> None:
        """A lookup found nothing: back off asking for the host token (1, 2, 4 ... tokens)."""
        self.misses += 1
        self.next_look = num_generated + min(2 ** (self.misses - 1), PROBE_EVERY)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials if self.trials else 0.0


class PastReply:
    """A finished reply kept as a draft source: the prompt's last ``MAX_NGRAM`` tokens (its
    first tokens' n-grams begin there), then the reply from ``reply_start`` on; indexed on
    first lookup."""

    def __init__(self, tokens: list[int], reply_start: int) -> None:
        self.tokens = tokens
        self.reply_start = reply_start
        self.index: NgramIndex | None = None

    def indexed(self) -> NgramIndex:
        if self.index is None:
            self.index = NgramIndex()
            self.index.update(self.tokens)
        return self.index


class StepCost:
    """What one more fed row costs a step of decodes, and what such a step yields, measured
    from the steps themselves (steps that read prompt tokens are left out).

    Medians of the last ``WINDOW`` steps, not running means: one step slowed by something
    else on the machine (another process, a page fault) would otherwise read as the price
    of its drafts, and drafting, once priced out, measures no more drafting steps to learn
    better (a busy 2-core machine showed thresholds above 1: no draft could ever pay)."""

    WINDOW = 16

    def __init__(self) -> None:
        self._plain: deque[float] = deque(maxlen=self.WINDOW)  # steps of decodes, no drafts
        self._rows: deque[int] = deque(maxlen=self.WINDOW)  # their decode rows
        self._extra: deque[float] = deque(maxlen=self.WINDOW)  # per draft row, over plain
        self._switch: deque[float] = deque(maxlen=self.WINDOW)  # per drafting step, less rows
        self.plain_s: float | None = None
        self.rows: float | None = None
        self.row_s: float | None = None
        #: what a drafting step costs over a plain one beside its rows (overlapped: mostly
        #: the lost overlap); None until a drafting step is measured
        self.switch_s: float | None = None

    def observe(self, step_s: float, decode_rows: int, draft_rows: int) -> None:
        if draft_rows == 0:
            self._plain.append(step_s)
            self._rows.append(decode_rows)
            self.plain_s = statistics.median(self._plain)
            self.rows = statistics.median(self._rows)
        elif self.plain_s is not None:
            extra = max(step_s - self.plain_s, 0.0)
            self._extra.append(extra / draft_rows)
            self.row_s = statistics.median(self._extra)
            rows_s = PRIOR_ROW_SHARE * self.plain_s * draft_rows
            self._switch.append(max(extra - rows_s, 0.0))
            self.switch_s = statistics.median(self._switch)

    def threshold(self, overlapped: bool = False) -> float:
        """``c * N / T``: the expected tokens a draft row must add to pay for itself.
        ``overlapped``: ``c`` is ``PRIOR_ROW_SHARE`` of a step (the switch is priced per
        step, :meth:`Speculator.wants_host_step`)."""
        if self.plain_s is None or not self.rows:
            return PRIOR_ROW_SHARE
        if overlapped:
            return PRIOR_ROW_SHARE * self.rows
        row_s = self.row_s if self.row_s is not None else PRIOR_ROW_SHARE * self.plain_s
        return row_s * self.rows / max(self.plain_s, 1e-9)


class Speculator:
    """Drafts for the engine's decoding sequences and their adaptive lengths (the public
    counters are the telemetry's, engine/runner/telemetry.py)."""

    def __init__(self, enabled: bool = True, max_draft: int = MAX_DRAFT,
                 overlapped: bool = False) -> None:
        """overlapped: the engine launches a step before reading the previous one (a GPU):
        the batch decides when to give the overlap up (:meth:`wants_host_step`)."""
        self.enabled = enabled
        self.max_draft = max_draft
        self.overlapped = overlapped
        self._launches = 0  # steps launched, for the probes' shared beat (overlapped)
        self.cost = StepCost()
        self._states: dict[int, DraftState] = {}  # by seq_id
        self._by_prompt: dict[int, dict[int, Sequence]] = {}  # prompt key -> seq_id -> seq
        self._past: OrderedDict[int, deque[PastReply]] = OrderedDict()  # prompt key -> replies

    # ---- which sequences draft --------------------------------------------------------------

    def eligible(self, seq: Sequence) -> bool:
        """Whether ``seq`` may draft at all: not a beam, not held to a grammar, not asking
        for log-probabilities (one entry per sampled position would be needed), not seeded
        (a seeded reply is reproducible; drafting's per-step decision depends on timing)."""
        params = seq.request.params
        return (self.enabled and seq.request.beams is None and seq.matcher is None
                and params.constraint is None and params.logprobs is None
                and params.seed is None and seq.num_generated >= 1)

    def wants_host_step(self, seqs: list[Sequence]) -> bool:
        """Overlapped: whether the step being launched should have its rows' newest tokens
        read before the next one is planned (that step may then draft, and the batch gives
        its overlap up): when the rows that would draft are expected to keep enough tokens
        to pay for the switch, on the probes' beat when a probe is due, or after a step that
        kept all of several drafts (see the module's docstring). Called once per launch."""
        if not self.enabled:
            return False
        self._launches += 1
        beat = self._launches % PROBE_EVERY == 0
        gain, drafts = 0.0, 0
        for seq in seqs:
            if not self.eligible(seq):
                continue
            state = self._states.get(seq.seq_id)
            if state is None:  # its first look waits for the beat
                if beat:
                    return True
                continue
            upcoming = seq.num_generated + 1
            if state.kept_all:
                return True  # a copy in progress
            if beat and state.probe_due(upcoming):
                return True  # before the misses' back-off: both keep time every
                # PROBE_EVERY, and out of phase they would never meet
            if upcoming < state.next_look:
                continue  # its lookups missed lately
            k = self.draft_length(state)
            if k:
                a = state.acceptance
                gain += sum(a ** j for j in range(1, k + 1))
                drafts += k
        cost = self.cost
        if not gain or cost.plain_s is None or not cost.rows:
            return False  # plain steps are measured first
        if cost.switch_s is None:
            return True  # no drafting step measured yet: this one measures the switch
        price = cost.switch_s + PRIOR_ROW_SHARE * cost.plain_s * drafts
        return gain * cost.plain_s / cost.rows >= price

    # ---- proposing --------------------------------------------------------------------------

    def propose(self, seq: Sequence) -> list[int]:
        """The drafts ``seq`` verifies in its next step (empty: it decodes one token)."""
        if not self.eligible(seq):
            return []
        state = self._state(seq)
        state.index.update(seq.tokens)
        limit = min(self.max_draft,
                    seq.request.params.max_tokens - seq.num_generated - 1)
        if limit <= 0:
            return []
        k = self.draft_length(state)
        if k == 0 and not state.probe_due(seq.num_generated):
            return []
        drafts, matched = self._lookup(seq, state, limit)
        if not drafts:
            state.missed(seq.num_generated)
            return []
        state.misses = 0
        state.last_try = seq.num_generated
        if k == 0:  # a probe: is the text repetitive?
            return drafts if matched >= MAX_NGRAM else drafts[:1]
        return drafts[:k]

    def draft_length(self, state: DraftState) -> int:
        """The largest j with ``a**j > threshold`` (capped at ``max_draft``)."""
        a = state.acceptance
        gamma = self.cost.threshold(self.overlapped)
        if a <= gamma or a <= 0.0:
            return 0
        if a >= 1.0 or gamma <= 0.0:
            return self.max_draft
        return max(0, min(self.max_draft, int(math.log(gamma) / math.log(a))))

    def _lookup(self, seq: Sequence, state: DraftState, limit: int) -> tuple[list[int], int]:
        """The continuation of the longest suffix n-gram matched in ``seq``'s own context
        or a sibling's tokens, and that n-gram's length; the longer match wins, then the
        sibling (its reply follows the same prompt), then the longer continuation.

        A sibling whose reply agrees with ``seq``'s at the same position (its last
        ``MAX_NGRAM`` tokens there equal ``seq``'s suffix) drafts what it has after that
        position first: the n-gram index keeps an n-gram's latest occurrence, and a reply
        that repeats itself (a small model's greedy loops) continues differently after its
        earlier ones; a regenerated greedy reply kept 23 of 64 drafts that way."""
        tokens = seq.tokens
        suffix = tokens[-MAX_NGRAM:]
        best: tuple[int, int, int] = (0, 0, 0)
        drafts: list[int] = []
        n, at = state.index.match(suffix)
        if n:
            drafts = tokens[at:at + limit]
            best = (n, 0, len(drafts))
        for other_tokens, reply_start, index in self._sibling_sources(seq, state.prompt_key):
            aligned = reply_start + seq.num_generated  # after as many reply tokens as seq's
            if (aligned >= len(suffix) and aligned < len(other_tokens)
                    and other_tokens[aligned - len(suffix):aligned] == suffix):
                n, at = MAX_NGRAM + 1, aligned  # outranks any n-gram match
            else:
                n, at = index.match(suffix)
            if not n:
                continue
            candidate = other_tokens[at:at + limit]
            score = (n, 1, len(candidate))
            if score > best:
                best, drafts = score, candidate
        return drafts, min(best[0], MAX_NGRAM)

    def _sibling_sources(self, seq: Sequence, key: int):
        """(tokens, where the reply starts in them, their up-to-date index) of every sibling
        still decoding, then of every earlier reply kept for the prompt ``key``."""
        for sibling in self._by_prompt.get(key, {}).values():
            if sibling is not seq and not sibling.finished:
                other = self._state(sibling)
                other.index.update(sibling.tokens)
                yield sibling.tokens, sibling.num_prompt, other.index
        for past in self._past.get(key, ()):
            yield past.tokens, past.reply_start, past.indexed()

    # ---- learning ---------------------------------------------------------------------------

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """``seq`` verified ``drafted`` drafts and kept the first ``accepted``."""
        state = self._states.get(seq.seq_id)
        if state is None:
            return
        rejected = 1 if accepted < drafted else 0
        state.kept_all = drafted >= 2 and accepted == drafted
        state.accepted = ACCEPT_DECAY * state.accepted + accepted
        state.trials = ACCEPT_DECAY * state.trials + accepted + rejected

    def observe_step(self, step_s: float, decode_rows: int, draft_rows: int,
                     prompt_tokens: int) -> None:
        """A step ended: its time teaches the cost model (steps reading prompts excluded)."""
        if prompt_tokens == 0 and decode_rows:
            self.cost.observe(step_s, decode_rows, draft_rows)

    def forget(self, seq: Sequence) -> None:
        """``seq`` left the engine: its index goes; its reply, when it has one worth
        keeping, stays a draft source for later requests with its prompt."""
        state = self._states.pop(seq.seq_id, None)
        if state is not None:
            group = self._by_prompt.get(state.prompt_key)
            if group is not None:
                group.pop(seq.seq_id, None)
                if not group:
                    del self._by_prompt[state.prompt_key]
        if (self.enabled and not seq.request.incognito and seq.request.beams is None
                and seq.num_generated >= MIN_KEPT_REPLY):
            key = state.prompt_key if state is not None else prompt_key(seq)
            start = max(seq.num_prompt - MAX_NGRAM, 0)
            replies = self._past.setdefault(key, deque(maxlen=KEPT_REPLIES))
            replies.append(PastReply(seq.tokens[start:], seq.num_prompt - start))
            self._past.move_to_end(key)
            if len(self._past) > KEPT_PROMPTS:
                self._past.popitem(last=False)

    def _state(self, seq: Sequence) -> DraftState:
        state = self._states.get(seq.seq_id)
        if state is None:
            key = prompt_key(seq)
            state = self._states[seq.seq_id] = DraftState(NgramIndex(), key)
            self._by_prompt.setdefault(key, {})[seq.seq_id] = seq
        return state


def prompt_key(seq: Sequence) -> int:
    """Which sequences are siblings: those with this key (the same prompt; an incognito
    request's samples only with each other, so no other chat drafts from its reply)."""
    prompt = tuple(seq.tokens[:seq.num_prompt])
    return hash((seq.request.request_id, prompt)) if seq.request.incognito else hash(prompt)
