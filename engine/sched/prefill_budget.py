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
speed and the average step at the target.
"""

from __future__ import annotations

#: Weight kept by the older measurements at each new one (the fit follows a changing mix).
DECAY = 0.7
#: Prompt tokens a step takes at least when it takes any: a long prompt always advances.
MIN_PROMPT_TOKENS = 8
#: A prompt too costly for one step's allowance runs at least once every this many steps.
MAX_SKIPPED_STEPS = 4
#: The spread of contexts (their weighted standard deviation, in tokens) under which the cost
#: line stays flat: a slope read from chunks a few tokens apart is the steps' noise (a cold
#: start fitted 3 ms per token of context from contexts 17 and 20, and the paste then skipped
#: every step it could).
MIN_CONTEXT_SPREAD = 64.0


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
                self._banked += allowance
                self.holding = True
                fresh = self.cost.tokens_within(allowance, 0)
                return int(max(self.min_chunk, min(self.max_chunk, fresh)))
            fits = self.min_chunk  # the guaranteed share
        else:
            fits = self.cost.tokens_within(allowance + self._banked, context)
        self._banked, self._skipped = 0.0, 0
        return int(max(self.min_chunk, min(self.max_chunk, fits)))

    def observe(self, step_s: float, decode_rows: int, prompt_tokens: int,
                prompt_context: float = 0.0) -> None:
        """Learn from one finished step; ``prompt_context``: the mean context its prompt
        tokens attended to (their positions' mean)."""
        if prompt_tokens == 0:
            if decode_rows:
                self.decode_s = _ema(self.decode_s, step_s)
            return
        if decode_rows and self.decode_s is None:
            return  # cannot tell the prompt's share of this step yet
        base = self.decode_s if decode_rows else 0.0
        self.cost.observe(prompt_context, max(step_s - base, 1e-9) / prompt_tokens)


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


def _ema(previous: float | None, value: float) -> float:
    return value if previous is None else previous + 0.3 * (value - previous)
