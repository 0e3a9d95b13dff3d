"""The adaptive prompt budget on a simulated step-time model (no model, no clock).

The simulated step costs ``decode`` plus a fixed prefill overhead plus a per-token cost, as
a real chunked prefill does (the overhead is the context gather, growing with the prompt);
the budget never sees those parameters, only the step times it is told.
"""

from __future__ import annotations

import pytest

from engine.sched.prefill_budget import PrefillBudget


def simulate(budget: PrefillBudget, decode: float, overhead: float, per_token: float,
             steps: int) -> list[float]:
    """Step times (relative to a pure decode step) while a long prompt prefills."""
    budget.observe(decode, decode_rows=4, prompt_tokens=0)  # a decode-only step first
    ratios = []
    for _ in range(steps):
        n = budget.budget(decoding=True)
        step = decode + overhead + per_token * n
        budget.observe(step, decode_rows=4, prompt_tokens=n)
        ratios.append(step / decode)
    return ratios


@pytest.mark.parametrize("decode, overhead, per_token", [
    (0.050, 0.002, 0.002),  # CPU-like: a prompt token costs a 25th of a decode step
    (0.010, 0.0005, 0.00002),  # GPU-like: prompt tokens are cheap
    (0.050, 0.010, 0.001),  # a large fixed cost per chunk (long context)
])
def test_steps_settle_at_the_target_multiple_of_a_decode_step(decode, overhead, per_token):
    budget = PrefillBudget(max_chunk=4096, min_chunk=16, target=2.0)
    ratios = simulate(budget, decode, overhead, per_token, steps=30)
    assert all(abs(r - 2.0) < 0.1 for r in ratios[-10:]), ratios
    assert budget.budget(decoding=False) == 4096  # a prompt alone runs at full chunk


def test_a_prompt_too_costly_for_the_target_still_advances_by_the_minimum():
    budget = PrefillBudget(max_chunk=256, min_chunk=16, target=2.0)
    simulate(budget, decode=0.05, overhead=0.08, per_token=0.001, steps=20)
    assert budget.budget(decoding=True) == 16


def test_target_zero_keeps_the_fixed_chunk():
    budget = PrefillBudget(max_chunk=256, min_chunk=16, target=0)
    simulate(budget, decode=0.05, overhead=0.0, per_token=0.01, steps=5)
    assert budget.budget(decoding=True) == 256
