"""The time left of a prompt being read, from the engine's progress (app/core/prefill_eta.py),
on a controlled clock."""

from __future__ import annotations

import pytest

from app.core.prefill_eta import PrefillEta, time_left_text


def test_time_left_follows_the_measured_rate() -> None:
    eta = PrefillEta()
    assert eta.update(10.0, 0, 3600) is None  # first sight: nothing measured
    assert eta.update(10.2, 100, 3600) is None  # too short a span to trust
    # 1,200 tokens in 2 s: 600 tokens/s, 2,400 left -> 4 s
    assert eta.update(12.0, 1200, 3600) == pytest.approx(4.0)
    assert eta.update(13.0, 1200, 3600) == pytest.approx(2400 * 3.0 / 1200)  # it slowed down


def test_a_prompt_that_starts_over_is_measured_again() -> None:
    eta = PrefillEta()
    eta.update(0.0, 0, 1000)
    assert eta.update(1.0, 500, 1000) == pytest.approx(1.0)
    assert eta.update(2.0, 0, 1000) is None  # preempted: its progress went back
    assert eta.update(2.1, 0, 2000) is None  # another request
    eta.reset()
    assert eta.update(5.0, 10, 2000) is None


@pytest.mark.parametrize("seconds, text", [(0.2, "about 1 s left"), (19.6, "about 20 s left"),
                                           (59.4, "about 59 s left"), (61, "about 1 min left"),
                                           (150, "about 2 min left")])
def test_time_left_reads_as_a_person_would_say_it(seconds, text) -> None:
    assert time_left_text(seconds) == text
