"""The engine's sampler against an independent numpy oracle (tests/reference.py), statistically.

For each setting, DRAWS tokens are drawn with the engine's batched sampler
(``engine.sampling.sample_rows``, one batch of DRAWS rows), twice: rows with their own PRNG
keys (seeded requests: one vmapped draw over the keys) and rows without (unseeded requests:
one draw on the step's shared key), each under fixed keys (deterministic: the same counts
on every run), and their frequencies are compared with
softmax(logits / T) restricted to the kept set: a token outside the set must never be
drawn, and Pearson's chi-square over the set must stay under its 1e-6 quantile. Each filter
and the repetition penalty is checked on its own, then all together, so a sampler that ignored
the temperature, a filter or the penalty fails here even if it reproduces its own draws.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from engine.config import SamplingParams
from engine.sampling import SamplingRow, new_key, sample_rows
from tests.reference import oracle_distribution

DRAWS = 2000
# Separated logits (no two kept/dropped decisions sit on a boundary), positive and negative.
LOGITS = np.array([3.0, 2.5, 2.0, 1.2, 1.0, 0.3, -0.5, -1.0, -2.0, -3.0], dtype=np.float32)


def chi2_quantile(df: int, z: float = 4.753) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal z
    (4.753: upper tail 1e-6)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def draw_counts(params: SamplingParams, history: list[int], draws: int = DRAWS,
                keyed: bool = True) -> np.ndarray:
    """Token counts of ``draws`` rows: each with its own key (keyed), or all without one,
    drawing from one shared key."""
    logits = mx.broadcast_to(mx.array(LOGITS), (draws, len(LOGITS)))
    keys = mx.random.split(mx.random.key(20240611), draws)
    rows = [SamplingRow(params, history, keys[i] if keyed else None) for i in range(draws)]
    tokens, _ = sample_rows(logits, rows, key=mx.random.key(612))
    return np.bincount(np.array(tokens).tolist(), minlength=len(LOGITS))


def assert_follows(params: SamplingParams, history: list[int] = ()) -> np.ndarray:
    history = list(history)
    expected = oracle_distribution(LOGITS, params, history)
    for keyed in (True, False):
        assert_counts_follow(expected, draw_counts(params, history, keyed=keyed))
    return expected


def assert_counts_follow(expected: np.ndarray, counts: np.ndarray) -> None:
    kept = expected > 0
    outside = counts[~kept].sum()
    assert outside == 0, f"{outside} draws of tokens outside the kept set {np.flatnonzero(kept)}"
    e = expected[kept] * counts.sum()
    chi2 = float(((counts[kept] - e) ** 2 / e).sum())
    df = int(kept.sum()) - 1
    if df > 0:
        assert chi2 < chi2_quantile(df), (
            f"chi-square {chi2:.1f} (df {df}): counts {counts[kept].tolist()}, "
            f"expected {np.round(e).astype(int).tolist()}"
        )


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_softmax(temperature):
    expected = assert_follows(SamplingParams(temperature=temperature))
    assert (expected > 0).all()


def test_top_p_keeps_the_smallest_set_reaching_p_and_tempers_inside_it():
    expected = assert_follows(SamplingParams(temperature=0.7, top_p=0.85))
    # p = softmax(LOGITS): the three most likely hold 0.823 < 0.85, the fourth brings 0.892
    assert np.flatnonzero(expected > 0).tolist() == [0, 1, 2, 3]


def test_top_k_keeps_the_k_most_likely():
    expected = assert_follows(SamplingParams(temperature=1.5, top_k=3))
    assert np.flatnonzero(expected > 0).tolist() == [0, 1, 2]


def test_min_p_keeps_tokens_above_a_fraction_of_the_top():
    expected = assert_follows(SamplingParams(temperature=1.0, min_p=0.2))
    # p_i / p_max = exp(l_i - 3): 0.61, 0.37, 0.17 ... only the first three reach 0.2
    assert np.flatnonzero(expected > 0).tolist() == [0, 1, 2]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    history = [0, 3, 7, 0]  # two positive logits and one negative, one token twice
    params = SamplingParams(temperature=1.0, repetition_penalty=1.8)
    expected = assert_follows(params, history)
    plain = oracle_distribution(LOGITS, SamplingParams(temperature=1.0))
    assert expected[0] < plain[0] and expected[3] < plain[3] and expected[7] < plain[7]


@pytest.mark.parametrize("window", [20, 64])
@pytest.mark.parametrize("inside", [True, False])
def test_repetition_penalty_window(window, inside):
    """Only the last repetition_context_size tokens count (mlx-lm's default is 20): token 1
    is penalised while it is inside the window, and not once it has left it."""
    history = [1] + [9] * (window - 1 if inside else window)
    params = SamplingParams(temperature=1.0, repetition_penalty=3.0,
                            repetition_context_size=window)
    expected = assert_follows(params, history)
    plain = oracle_distribution(LOGITS, SamplingParams(temperature=1.0), [9])
    assert (expected[1] < plain[1]) == inside


def test_rows_with_different_windows_share_one_step():
    """A batch mixing a 5-token and a 64-token window: each row follows its own oracle (the
    rows are padded to the widest window without penalising anything more)."""
    history = [1] + [9] * 10
    narrow = SamplingParams(temperature=1.0, repetition_penalty=3.0, repetition_context_size=5)
    wide = SamplingParams(temperature=1.0, repetition_penalty=3.0, repetition_context_size=64)
    half = DRAWS // 2
    logits = mx.broadcast_to(mx.array(LOGITS), (DRAWS, len(LOGITS)))
    keys = mx.random.split(mx.random.key(7), DRAWS)
    rows = [SamplingRow(narrow if i < half else wide, history, keys[i]) for i in range(DRAWS)]
    tokens = np.array(sample_rows(logits, rows)[0]).tolist()
    for params, drawn in ((narrow, tokens[:half]), (wide, tokens[half:])):
        expected = oracle_distribution(LOGITS, params, history)
        counts = np.bincount(drawn, minlength=len(LOGITS))
        kept = expected > 0
        e = expected[kept] * half
        chi2 = float(((counts[kept] - e) ** 2 / e).sum())
        assert chi2 < chi2_quantile(int(kept.sum()) - 1), (params, counts.tolist())
    assert oracle_distribution(LOGITS, narrow, history)[1] > oracle_distribution(
        LOGITS, wide, history)[1]


def test_filters_and_penalty_together():
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=5, min_p=0.05,
                            repetition_penalty=1.3)
    expected = assert_follows(params, [1, 6])
    assert 2 <= (expected > 0).sum() <= 5


def test_greedy_is_the_argmax_after_the_penalty():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    for keyed in (True, False):
        counts = draw_counts(params, [0], draws=50, keyed=keyed)
        # 3.0 / 2 = 1.5 < 2.5: the penalty moves the argmax from token 0 to token 1
        assert counts[1] == 50


def test_seeded_keys_give_each_sample_its_own_stream():
    a0, a1 = new_key(5, 0), new_key(5, 1)
    assert not np.array_equal(np.array(a0), np.array(a1))
    assert np.array_equal(np.array(new_key(5, 1)), np.array(a1))


def test_rows_without_a_key_draw_from_the_shared_key_alone() -> None:
    """Unseeded rows: the shared key decides their tokens (the same key, the same tokens;
    another key, others), and the draw does not repeat one number across rows."""
    logits = mx.broadcast_to(mx.array(LOGITS), (64, len(LOGITS)))
    rows = [SamplingRow(SamplingParams(temperature=1.0), [], None)] * 64
    first = sample_rows(logits, rows, key=mx.random.key(1))[0].tolist()
    assert sample_rows(logits, rows, key=mx.random.key(1))[0].tolist() == first
    assert sample_rows(logits, rows, key=mx.random.key(2))[0].tolist() != first
    assert len(set(first)) > 3
