"""How many prompt tokens a step may take while other chats decode: a latency budget.

A fixed chunk is a token count, and a prompt token costs more the longer the context it
attends to, so a long paste could make every step of the chats that are streaming take
seconds. Instead, while any chat decodes, the budget aims each step at ``target`` times a
pure decode step: from the measured decode-step time and the measured cost of a prompt token
*at the context it is read at* (a line fitted to recent steps, cost = a + b * context), it
admits the prompt tokens that fit. A prompt alone gets the whole ``max_chunk``.

When not even ``min_chunk`` tokens fit at a prompt's context (a very long paste beside fast
decodes), the prompt skips steps: each skipped step banks its allowance, and the prompt runs
once the bank pays for a chunk, or after ``MAX_SKIPPED_STEPS`` at the latest (its
guaranteed share: it always finishes). The streaming chats then see most steps at decode
speed and the average step at the target. **No step past the peak**: what a bank pays for
is capped at ``PEAK_OVER_TARGET`` times the target step, so a prompt that skipped steps runs
a chunk that fits under that peak, not one that spends the whole bank at once (the streams'
p99 gap is their slowest steps, issue #24: banked chunks of 14 tokens at 3,000 tokens of
context cost 3-3.5 decode steps on the CPU where the target was 2). What the chunk leaves of
the credit stays banked, so the cap costs the prompt no share. Where even ``min_chunk``
costs more than the peak at the prompt's context, the prompt runs ``min_chunk`` alone as
soon as the bank pays for it: the least a step can pass the peak by.

**Free tokens (a step bound by its launch).** On a GPU a small model's step costs its
launches, not its arithmetic: the H200 read 64 prompt tokens beside five decodes at the cost
of the decode step alone (5.7-7.6 ms against 6.6), and 140 tokens at 14-21 ms. A price per
token fitted to those free chunks went flat (0.05 ms a token), so the budget admitted 120-170
tokens and those steps were the streams' p99. So the budget keeps a *knee*: the most prompt
tokens a recent step carried at no measurable cost (within ``FREE_SHARE`` of a decode step,
the steps' own noise), and prices only the tokens past it; free steps confirm the knee and
never pull the price down. A step no larger than the knee that was not free (the CPU, where
a chunk at a long context re-reads that context) drops the knee at once: a price per token
as before. Before any costly step is seen, the budget offers half again what it found free
(a slow start, one bucket a step: doubling overshot a 128-token knee by 3 decode steps where
tokens past it cost 0.1 ms each).

**Probing past the knee.** A free step confirms the knee and never re-prices the tokens past
it, so a line once fitted too steep (a slow step a few tokens past the knee prices each of
them at the whole step's excess) stays: the budget offers what that line allows, rounded to a
bucket; the step is free; the next offer is the same. On an H100 a paste ran 8-32 tokens a
step to its end that way in half of 8 runs (2.5-3.4 s among the chats against 1.3-1.4 s:
bench/results/gpu.md, session 23). So after ``PROBE_AFTER`` free steps in a row that could
not grow the knee, the next step offers half the knee more (at least ``min_chunk``): free, it
raises the knee; costly, it prices the tokens past the knee at the current context. It probes
also where the line's offer is past the knee: a paste yielding to a focused chat takes only
``free_tokens``, so a knee its yield share had set would hold it at that share to its end
(tests/test_prefill_budget.py; on session 27's H100, steps of 64 and 256 tokens cost the
same). A costly
probe doubles the free steps the next one waits for (up to ``PROBE_MAX_AFTER``), so where the
line was right probes stay rare; a free one resets the wait. A probe is the one step the
budget lets pass its target on purpose. On the CPU steps are seldom free (its knee is 0): no
probes.

**Stable shapes.** ``floor`` (a GPU: engine/loading.py passes the step's bucket rounding)
rounds a budget that is not the whole chunk down to a bucketed size, so a paste's chunks
repeat a few shapes and the backend reuses its compiled graphs and matmul plans instead of
planning a new token count nearly every step.

The decode step the target multiplies is the median of the last ``DECODE_WINDOW`` steps of
decodes only: one slow step (a page fault, another process) must not set the target.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

#: Weight kept by the older measurements at each new one (the fit follows a changing mix).
DECAY = 0.7
#: Prompt tokens a step takes at least when it takes any: a long prompt always advances.
MIN_PROMPT_TOKENS = 8
#: A prompt too costly for one step's allowance runs at least once every this many steps.
MAX_SKIPPED_STEPS = 4
#: The most a step that spends banked allowance may cost, as a multiple of the target step
#: (2.4 decode steps at the default target of 2: under issue #24's p99 bound of 2.5 with the
#: steps' own noise to spare).
PEAK_OVER_TARGET = 1.2
#: The spread of contexts (their weighted standard deviation, in tokens) under which the cost
#: line stays flat: a slope read from chunks a few tokens apart is the steps' noise (a cold
#: start fitted 3 ms per token of context from contexts 17 and 20, and the paste then skipped
#: every step it could).
MIN_CONTEXT_SPREAD = 64.0
#: A prompt step whose time exceeds the decode step by at most this share carried its prompt
#: tokens for free (the noise of a step's time: the H200's decode steps spread +-15%).
FREE_SHARE = 0.15
#: The knee is the largest of this many latest free chunks (forgotten at once when a chunk
#: no larger than the knee is not free: a longer context, or no launch-bound step at all).
KNEE_WINDOW = 8
#: Decode-only steps whose median is the decode step.
DECODE_WINDOW = 16
#: Free steps in a row at (or under) the knee after which the next step probes past it.
PROBE_AFTER = 8
#: The longest wait between probes, after costly ones (each doubles the wait).
PROBE_MAX_AFTER = 128


class PrefillBudget:
    def __init__(self, max_chunk: int, min_chunk: int, target: float,
                 floor: Callable[[int], int] | None = None) -> None:
        """target: step time over a pure decode step (0 disables: always ``max_chunk``);
        min_chunk: tokens a long prompt advances at least when it runs; floor: rounds a
        budget down to a stable shape (None: any count)."""
        self.max_chunk = max_chunk
        self.min_chunk = min(min_chunk, max_chunk)
        self.target = target
        self.floor = floor
        self.decode_s: float | None = None  # a step of decodes only (recent median)
        self._decodes: deque[float] = deque(maxlen=DECODE_WINDOW)
        self.cost = TokenCost()  # what one prompt token past the knee adds, by its context
        self._free: deque[int] = deque(maxlen=KNEE_WINDOW)  # the latest free chunks' sizes
        self._banked = 0.0  # allowance saved by skipped steps (seconds)
        self._skipped = 0
        self._free_run = 0  # free steps in a row that did not raise the knee
        self._probe_after = PROBE_AFTER  # free steps the next probe waits for
        #: The size of the probe under way, until its step is observed (an overlapped engine
        #: asks the next step's budget before it observes the last step).
        self._probe_tokens: int | None = None
        #: The last budget() skipped the prompts under way (new prompts may still start).
        self.holding = False
        #: How many of the last budget()'s tokens cost the decoding chats nothing measurable:
        #: up to the knee, or the whole offer of a step that tests for more (a probe, the slow
        #: start). A prompt that yields to a chat of higher priority may still take these
        #: (engine/sched/scheduler.py's ``YieldShare``): they do not slow that chat.
        self.free_tokens = 0

    def budget(self, decoding: bool, context: int = 0) -> int:
        """Prompt tokens for the next step, given whether any chat is decoding in it and the
        context the step's prompt continues from (the longest of the prompts under way; 0
        for a fresh prompt). When the prompt under way skips this step (see the module
        docstring), ``holding`` is set and the budget is what a fresh prompt may take.
        """
        self.holding = False
        self.free_tokens = 0
        if not decoding or not self.target:
            self._banked, self._skipped = 0.0, 0
            return self.max_chunk
        if self.decode_s is None:
            return self.min_chunk  # no measurement yet: start small, learn from this step
        knee = self.knee
        if not self.cost.ready:  # every chunk so far was free: try half again the largest
            self.free_tokens = self._shaped(knee + max(self.min_chunk, knee // 2))
            return self.free_tokens
        allowance = (self.target - 1.0) * self.decode_s
        peak = (PEAK_OVER_TARGET * self.target - 1.0) * self.decode_s
        credit = self._banked + allowance
        smallest = self._price(self.min_chunk, context, knee)
        if smallest > credit and self._skipped < MAX_SKIPPED_STEPS:  # the bank cannot pay yet
            self._skipped += 1
            self._banked = credit
            self.holding = True
            fresh = self._shaped(knee + self.cost.tokens_within(allowance, knee))
            self.free_tokens = min(fresh, knee)
            return fresh
        if smallest > min(credit, peak):  # the guaranteed share, or a smallest chunk past
            fits = self._shaped(self.min_chunk)  # the peak that the bank now pays for
        else:
            fits = self._shaped(knee + self.cost.tokens_within(min(credit, peak),
                                                               context + knee))
        self.free_tokens = min(fits, knee)
        # Free steps that did not raise the knee: the line offered no more (fits <= knee), or
        # the prompt took no more (a paste yielding to a focused chat takes the free tokens
        # only, so with the line's offer past the knee it would never test past it).
        if knee and self._free_run >= self._probe_after:
            probe = self._shaped(knee + max(self.min_chunk, knee // 2))
            if probe > knee:
                fits, self._probe_tokens, self._free_run = max(fits, probe), probe, 0
                self.free_tokens = probe
        # A prompt whose smallest chunk costs more than a step's allowance keeps what its
        # chunk left of the credit (the peak capped the chunk: that allowance is its share,
        # not lost), at most one peak step's worth; one that fits every step banks nothing.
        left = credit - self._price(fits, context, knee) if smallest > allowance else 0.0
        self._banked = min(max(left, 0.0), peak)
        self._skipped = 0
        return fits

    @property
    def knee(self) -> int:
        """Prompt tokens a recent step carried at no measurable cost (0: none did)."""
        return max(self._free, default=0)

    def _price(self, tokens: int, context: int, knee: int) -> float:
        """Seconds ``tokens`` prompt tokens from ``context`` on add to a step."""
        past = tokens - knee
        return self.cost.of(past, context + knee) if past > 0 else 0.0

    def _shaped(self, tokens: int) -> int:
        tokens = int(max(self.min_chunk, min(self.max_chunk, tokens)))
        if self.floor is not None and tokens < self.max_chunk:
            tokens = max(self.min_chunk, self.floor(tokens))
        return tokens

    def observe(self, step_s: float, decode_rows: int, prompt_tokens: int,
                prompt_context: float = 0.0) -> None:
        """Learn from one finished step; ``prompt_context``: the mean context its prompt
        tokens attended to (their positions' mean)."""
        if prompt_tokens == 0:
            if decode_rows:
                self._decodes.append(step_s)
                self.decode_s = statistics.median(self._decodes)
            return
        if decode_rows and self.decode_s is None:
            return  # cannot tell the prompt's share of this step yet
        base = self.decode_s if decode_rows else 0.0
        extra = step_s - base
        probed = prompt_tokens == self._probe_tokens
        if probed:
            self._probe_tokens = None
        if decode_rows and extra <= FREE_SHARE * base:
            raised = prompt_tokens > self.knee
            self._free.append(prompt_tokens)  # free: the knee is at least this
            self._free_run = 0 if raised else self._free_run + 1
            if probed:
                self._probe_after = PROBE_AFTER
            return
        self._free_run = 0
        if probed:
            self._probe_after = min(2 * self._probe_after, PROBE_MAX_AFTER)
        knee = self.knee
        if prompt_tokens <= knee:
            self._free.clear()  # tokens under the knee cost something: there is none
            knee = 0
        # priced past the knee; a chunk not past it (a slow step's noise) at its whole size
        priced = prompt_tokens - knee if prompt_tokens > knee else prompt_tokens
        self.cost.observe(prompt_context + (prompt_tokens - priced) / 2,
                          max(extra, 1e-9) / priced)


class TokenCost:
    """A prompt token's cost as a line in its context, ``a + b * context``, fitted by
    exponentially weighted least squares (``DECAY``), so the cost of a chunk at 3,000 tokens
    of context is not taken from a short prompt's chunk just before it."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def ready(self) -> bool:
        return self._w > 0.0

    def observe(self, context: float, seconds_per_token: float) -> None:
        d = DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + context
        self._y = d * self._y + seconds_per_token
        self._xx = d * self._xx + context * context
        self._xy = d * self._xy + context * seconds_per_token

    def line(self) -> tuple[float, float]:
        """(a, b): the cost of a token at context 0 and what each token of context adds
        (b >= 0; a flat line, the recent mean, while the contexts seen lie within
        ``MIN_CONTEXT_SPREAD`` of each other)."""
        mx_, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx_ * mx_
        b = (self._xy / self._w - mx_ * my) / var if var > MIN_CONTEXT_SPREAD**2 else 0.0
        b = max(b, 0.0)
        return max(my - b * mx_, 1e-9), b

    def of(self, tokens: int, context: int) -> float:
        """Seconds ``tokens`` prompt tokens add to a step, read from ``context`` on."""
        a, b = self.line()
        return tokens * max(a + b * (context + tokens / 2.0), 1e-9)

    def tokens_within(self, seconds: float, context: int) -> int:
        """The most prompt tokens from ``context`` on that add at most ``seconds``: the
        positive root of (b/2) n^2 + (a + b context) n = seconds."""
        a, b = self.line()
        linear = max(a + b * context, 1e-9)
        if b <= 0.0:
            return int(seconds / linear)
        half = b / 2.0
        return int((-linear + (linear * linear + 4.0 * half * seconds) ** 0.5) / (2.0 * half))
