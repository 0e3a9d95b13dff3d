"""How many prompt tokens a step may take while other chats decode: a latency budget.

A fixed chunk is a token count, and a prompt token costs more the longer the context it
attends to, so a long paste could make every step of the chats that are streaming take
seconds. Instead, while any chat decodes, the budget aims each step at ``target`` times a
pure decode step: from the measured decode-step time and the measured cost of a chunk
(``TokenCost``: a fixed part per chunk, plus per token a part that grows with the context the
token attends to, fitted to recent steps), it admits the prompt tokens that fit. A prompt
alone gets the whole ``max_chunk``.

When not even ``min_chunk`` tokens fit at a prompt's context (a very long paste beside fast
decodes), the prompt skips steps: each skipped step banks its allowance, and the prompt runs
once the bank pays for a chunk, or after ``MAX_SKIPPED_STEPS`` at the latest (its
guaranteed share: it always finishes). The streaming chats then see most steps at decode
speed and the average step at the target.
"""

from __future__ import annotations

import numpy as np

#: Weight kept by the older measurements at each new one (the fit follows a changing mix).
DECAY = 0.7
#: Prompt tokens a step takes at least when it takes any: a long prompt always advances.
MIN_PROMPT_TOKENS = 8
#: A chunk is at most this many times the largest one measured so far beside decodes.
GROWTH = 2
#: A prompt too costly for one step's allowance runs at least once every this many steps.
MAX_SKIPPED_STEPS = 4


class PrefillBudget:
    def __init__(self, max_chunk: int, min_chunk: int, target: float) -> None:
        """target: step time over a pure decode step (0 disables: always ``max_chunk``);
        min_chunk: tokens a long prompt advances at least when it runs."""
        self.max_chunk = max_chunk
        self.min_chunk = min(min_chunk, max_chunk)
        self.target = target
        self.decode_s: float | None = None  # a step of decodes only
        self.cost = TokenCost()  # what one prompt token adds to a step, by its context
        self._banked = 0.0  # allowance saved by skipped steps (seconds)
        self._skipped = 0
        self._largest_seen = 0  # the largest chunk measured beside decodes
        self._per_token: float | None = None  # measured seconds per prompt token (EMA)
        #: The last budget() skipped the prompts under way (new prompts may still start).
        self.holding = False

    def budget(self, decoding: bool, context: int = 0) -> int:
        """Prompt tokens for the next step, given whether any chat is decoding in it and the
        context the step's prompt continues from (the longest of the prompts under way; 0
        for a fresh prompt). When the prompt under way skips this step (see the module
        docstring), ``holding`` is set and the budget is what a fresh prompt may take.
        """
        self.holding = False
        if not decoding or not self.target:
            self._banked, self._skipped = 0.0, 0
            return self.max_chunk
        if self.decode_s is None or not self.cost.ready:
            return self.min_chunk  # no measurement yet: start small, learn from this step
        allowance = (self.target - 1.0) * self.decode_s
        if self.cost.of(self.min_chunk, context) > allowance + self._banked:
            if self._skipped < MAX_SKIPPED_STEPS:
                self._skipped += 1
                # at most one step's allowance kept: a chunk step stays within twice the
                # target's extra time (banking four steps made 6x steps: the p99 gap)
                self._banked = min(self._banked + allowance, allowance)
                self.holding = True
                fresh = self.cost.tokens_within(allowance, 0)
                return int(max(self.min_chunk, min(self.max_chunk, fresh)))
            fits = self.min_chunk  # the guaranteed share
        else:
            fits = self.cost.tokens_within(allowance + self._banked, context)
            if self._per_token:  # and at most 3x what the measured average cost allows
                fits = min(fits, int(3 * (allowance + self._banked) / self._per_token))
        self._banked, self._skipped = 0.0, 0
        # never more than twice the largest chunk measured: a fit is an extrapolation, and
        # one wrong by 10x would stall every streaming chat for seconds
        ceiling = max(self.min_chunk, GROWTH * self._largest_seen)
        return int(max(self.min_chunk, min(self.max_chunk, ceiling, fits)))

    def observe(self, step_s: float, decode_rows: int, prompt_tokens: int,
                prompt_context: float = 0.0) -> None:
        """Learn from one finished step; ``prompt_context``: the mean context its prompt
        tokens attended to (their positions' mean)."""
        if prompt_tokens == 0:
            if decode_rows:
                self.decode_s = _ema(self.decode_s, step_s)
            return
        if not decode_rows or self.decode_s is None:
            # a prompt alone (the budget does not apply: it runs at max_chunk), or a step
            # whose prompt share cannot be told yet
            return
        self.cost.observe(prompt_tokens, prompt_context, max(step_s - self.decode_s, 0.0))
        self._largest_seen = max(self._largest_seen, prompt_tokens)
        self._per_token = _ema(self._per_token, max(step_s - self.decode_s, 1e-9) / prompt_tokens)


class TokenCost:
    """What a step's prompt chunk adds to it: ``fixed + n * (a + b * context)`` seconds for
    ``n`` tokens read at a mean context ``context``, fitted by exponentially weighted least
    squares (``DECAY``) over the steps that decoded too, all three terms >= 0.

    The fixed term is what a chunk costs whatever its size (gathering its context for
    attention, the chunk's own graph): without it a small chunk's cost per token looks high,
    the next chunk is made smaller still, and a paste crawls. The context term is attention
    over the tokens before: a chunk at 3,000 tokens of context is not priced like a short
    prompt's chunk just before it."""

    _SCALE = np.array([1.0, 100.0, 100_000.0])  # feature scales: a well-conditioned solve

    def __init__(self) -> None:
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)
        self._w = 0.0
        self._terms = np.zeros(3)

    @property
    def ready(self) -> bool:
        return self._w > 0.0

    def observe(self, tokens: int, context: float, seconds: float) -> None:
        """One chunk of ``tokens`` at mean ``context`` added ``seconds`` to its step."""
        x = np.array([1.0, tokens, tokens * context]) / self._SCALE
        self._xx = DECAY * self._xx + np.outer(x, x)
        self._xy = DECAY * self._xy + x * seconds
        self._w = DECAY * self._w + 1.0
        self._terms = self._solve()

    def _solve(self) -> np.ndarray:
        """Non-negative terms: least squares, then refitted without any that came out
        negative (three unknowns: a few passes settle it). A small ridge keeps a term that
        the data cannot tell apart (every chunk of one size) at its share of the mean."""
        ridge = 1e-6 * (np.trace(self._xx) + 1e-12)
        free = [0, 1, 2]
        terms = np.zeros(3)
        for _ in range(3):
            sub = self._xx[np.ix_(free, free)] + ridge * np.eye(len(free))
            solved = np.linalg.solve(sub, self._xy[free])
            if (solved >= 0).all():
                terms[:] = 0.0
                terms[free] = solved
                break
            free = [f for f, v in zip(free, solved) if v > 0]
            if not free:
                break
        return terms / self._SCALE

    def line(self) -> tuple[float, float, float]:
        """(fixed, a, b): seconds per chunk, per token, per token and token of context."""
        fixed, a, b = (float(v) for v in self._terms)
        return fixed, max(a, 1e-9), b

    def of(self, tokens: int, context: int) -> float:
        """Seconds ``tokens`` prompt tokens add to a step, read from ``context`` on."""
        fixed, a, b = self.line()
        return fixed + tokens * (a + b * (context + tokens / 2.0))

    def tokens_within(self, seconds: float, context: int) -> int:
        """The most prompt tokens from ``context`` on that add at most ``seconds``: the
        positive root of (b/2) n^2 + (a + b context) n = seconds - fixed."""
        fixed, a, b = self.line()
        left = seconds - fixed
        if left <= 0.0:
            return 0
        linear = a + b * context
        if b <= 0.0:
            return int(left / linear)
        half = b / 2.0
        return int((-linear + (linear * linear + 4.0 * half * left) ** 0.5) / (2.0 * half))


def _ema(previous: float | None, value: float) -> float:
    return value if previous is None else previous + 0.3 * (value - previous)
