"""How long a prompt still takes to read: the engine's progress over time, for the pane.

The engine reports, per chat, how many prompt tokens it has computed (the pool snapshot's
``prompt_tokens_done`` / ``prompt_tokens_total``, a few times a second). The rate since the
prompt was first seen in progress gives the time left; nothing is guessed before the engine
has moved for half a second, and a prompt that starts over (preempted, another request)
starts the measurement over.
"""

from __future__ import annotations

#: The engine must have read for this long before a rate is trusted.
MIN_SPAN_S = 0.5


class PrefillEta:
    def __init__(self) -> None:
        self._start: tuple[float, int] | None = None
        self._total = 0

    def update(self, now: float, done: int, total: int) -> float | None:
        """Seconds left to read ``total`` tokens with ``done`` read at ``now`` (None: not
        known yet)."""
        if self._start is None or total != self._total or done < self._start[1]:
            self._start, self._total = (now, done), total
            return None
        t0, d0 = self._start
        if now - t0 < MIN_SPAN_S or done <= d0:
            return None
        return (total - done) * (now - t0) / (done - d0)

    def reset(self) -> None:
        self._start = None


def time_left_text(seconds: float) -> str:
    """"about 20 s left", "about 2 min left": rounded as a person would say it."""
    if seconds < 59.5:
        return f"about {max(1, round(seconds))} s left"
    return f"about {round(seconds / 60)} min left"
