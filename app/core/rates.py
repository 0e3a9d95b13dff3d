"""The one tokens/s a chat shows: in its pane's footer and in the monitor's chat table.

The engine measures each chat's speed over its last 2 s (`SessionStats.tokens_per_s`, the
same window as the pool's own speed counter). The footer once showed the last reply's
average decode speed instead, so at the same moment the footer said 1.0 tok/s and the
monitor 4.0 for one chat (issue 11). Both now show `shown_rate`, formatted by `fmt_rate`;
a finished reply's average stays in that reply's own header, labelled as its own.
"""

from __future__ import annotations

IDLE_BELOW = 0.05  # tok/s: the engine's 2 s window lingers after a chat stops; that is idle
NO_RATE = "–"


def shown_rate(tokens_per_s: float, state: object) -> float | None:
    """The speed to show for a chat the engine reports in `state`, or None (idle)."""
    state = str(getattr(state, "value", state))
    if state == "finished" or tokens_per_s < IDLE_BELOW:
        return None
    return float(tokens_per_s)


def fmt_rate(rate: float | None) -> str:
    """'12.3', or '–' for no speed."""
    return NO_RATE if rate is None else f"{rate:.1f}"
