"""The bench's repeat/verdict logic (bench/engine_bench.py), without a model: sides run
interleaved A B A B ..., ratios are per repeat, and a verdict needs every repeat to agree."""

from __future__ import annotations

import pytest

from bench.engine_bench import (
    Comparison,
    Side,
    Spread,
    Workload,
    ratio_spread,
    run_interleaved,
    verdict,
)


def test_sides_run_interleaved_and_every_value_is_kept():
    calls: list[str] = []

    def side(name: str, values: list[float]) -> Side:
        it = iter(values)
        return Side(name, lambda: (calls.append(name), next(it))[1])

    w1 = Workload("w1", [side("A", [1.0, 3.0, 2.0]), side("B", [10.0, 30.0, 20.0])])
    w2 = Workload("w2", [side("C", [5.0, 6.0, 7.0])])
    results = run_interleaved([w1, w2], repeats=3, log=lambda _m: None)
    assert calls == ["A", "B", "C"] * 3
    assert results[("w1", "A")].values == (1.0, 3.0, 2.0)
    assert results[("w1", "A")].median == 2.0 and results[("w1", "B")].hi == 30.0
    assert ratio_spread(results[("w1", "A")], results[("w1", "B")]).values == (0.1, 0.1, 0.1)


@pytest.mark.parametrize("ratios,target,higher,expected", [
    ((1.4, 1.5, 1.35), 1.3, True, "met"),
    ((1.0, 1.2, 1.1), 1.3, True, "**not met**"),
    ((1.1, 1.4, 1.3), 1.3, True, "inconclusive (spread spans the target)"),
    ((1.1, 1.9, 1.5), 2.0, False, "met"),
    ((2.1, 2.5, 3.0), 2.0, False, "**not met**"),
    ((1.5, 2.5, 1.9), 2.0, False, "inconclusive (spread spans the target)"),
    ((1.1, 1.2, 1.05), None, True, "A > B in every repeat"),
    ((0.8, 0.9, 0.95), None, True, "A < B in every repeat"),
    ((0.9, 1.1, 1.0), None, True, "no clear difference (within the spread)"),
])
def test_verdict_only_when_the_spread_is_on_one_side(ratios, target, higher, expected):
    assert verdict(Spread(ratios), target, higher) == expected


def test_a_row_shows_medians_spreads_and_the_per_repeat_ratio():
    results = {("t", "A"): Spread((10.0, 12.0, 11.0)), ("t", "B"): Spread((10.0, 8.0, 10.0))}
    row = Comparison("tokens/s", ("t", "A"), ("t", "B"), target=1.3).row(results)
    # per-repeat ratios 1.0, 1.5, 1.1: median 1.1, spread 1.0-1.5 spans 1.3
    assert row == ("| tokens/s | 11.0 (10.0–12.0) | 10.0 (8.0–10.0) (B) | 1.10 (1.00–1.50)x "
                   "| >= 1.3x | inconclusive (spread spans the target) |")
