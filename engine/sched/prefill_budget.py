"""How many prompt tokens a step may take while other chats decode: a latency budget.

A fixed chunk is a token count, and a token costs more as the context grows, so a long
paste could make every step of the chats that are streaming take seconds. Instead, while
any chat decodes, the budget aims each step at ``target`` times a pure decode step: from
the measured decode-step time and the measured cost of a prompt token, it admits the
prompt tokens that fit. A prompt with nobody decoding gets the whole ``max_chunk``.
"""

from __future__ import annotations

ALPHA = 0.3  # weight of the newest measurement
#: Prompt tokens a step takes at least: a long prompt always advances, however slow.
MIN_PROMPT_TOKENS = 8


class PrefillBudget:
    def __init__(self, max_chunk: int, min_chunk: int, target: float) -> None:
        """target: step time over a pure decode step (0 disables: always ``max_chunk``);
        min_chunk: tokens a long prompt advances at least, so it is never starved."""
        self.max_chunk = max_chunk
        self.min_chunk = min(min_chunk, max_chunk)
        self.target = target
        self.decode_s: float | None = None  # a step of decodes only
        self.token_s: float | None = None  # what one prompt token adds to a step

    def budget(self, decoding: bool) -> int:
        """Prompt tokens for the next step, given whether any chat is decoding in it."""
        if not decoding or not self.target:
            return self.max_chunk
        if self.decode_s is None or self.token_s is None:
            return self.min_chunk  # no measurement yet: start small, learn from this step
        fits = (self.target - 1.0) * self.decode_s / self.token_s
        return int(max(self.min_chunk, min(self.max_chunk, fits)))

    def observe(self, step_s: float, decode_rows: int, prompt_tokens: int) -> None:
        """Learn from one finished step."""
        if prompt_tokens == 0:
            if decode_rows:
                self.decode_s = _ema(self.decode_s, step_s)
            return
        base = self.decode_s if decode_rows and self.decode_s is not None else 0.0
        if decode_rows and self.decode_s is None:
            return  # cannot tell the prompt's share of this step yet
        self.token_s = _ema(self.token_s, max(step_s - base, 1e-9) / prompt_tokens)


def _ema(previous: float | None, value: float) -> float:
    return value if previous is None else previous + ALPHA * (value - previous)
