"""Top-p on the CPU from the row's top candidates (engine/runner/sampling.py ``nucleus``)
against a float64 oracle and against mlx-lm's ``apply_top_p``.

* The oracle keeps a token when the mass of the strictly more likely tokens, summed in
  float64, is below top_p times the row's mass (tests/reference.py's definition).
* Where the nucleus lies within the candidates, ``nucleus`` may disagree with the oracle only
  on tokens whose mass above sits within float32 rounding of the boundary (a sum of up to
  1,024 terms), and it disagrees with the oracle no more often than mlx-lm's own function
  does (whose sequential float32 sum of the whole sorted row drifts by up to ~1e-4 on a 49k
  vocabulary).
* A row whose nucleus is wider than the candidates (a flat distribution) takes mlx-lm's full
  sort: its result equals ``apply_top_p`` exactly. With the fallback removed from a copy of
  the function, those rows come out truncated and the check fails.
* Draws through the engine's sampler on a realistic vocabulary follow the oracle's
  distribution (Pearson's chi-square, as tests/test_sampling.py does on ten tokens).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_top_p

from engine.config import SamplingParams
from engine.runner import sampling
from engine.runner.sampling import NUCLEUS_CANDIDATES, SamplingRow, new_key, nucleus, sample_rows
from tests.reference import oracle_distribution
from tests.test_sampling import chi2_quantile

VOCAB = 49152
#: How far from the boundary float32 may misplace a token: the rounding of a sequential sum
#: of up to NUCLEUS_CANDIDATES probabilities (half a unit in the last place of 1 each).
ROUNDING = NUCLEUS_CANDIDATES * 2.0**-24


def _rows(rng: np.random.Generator, count: int, scale: float) -> mx.array:
    x = rng.standard_normal((count, VOCAB)).astype(np.float32) * np.float32(scale)
    x[0, :40] = x[0, :1]  # ties among the likely tokens
    logits = mx.array(x)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _oracle_keeps(row: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(kept, distance): float64 decisions and each token's |mass above - top_p * total|."""
    p = np.exp(row.astype(np.float64))
    order = np.argsort(-p, kind="stable")
    sorted_p = p[order]
    # mass of the strictly more likely tokens (ties count as neither above nor below)
    above_sorted = np.cumsum(sorted_p) - sorted_p
    first_of_value = np.searchsorted(-sorted_p, -sorted_p, side="left")
    above = np.empty_like(p)
    above[order] = above_sorted[first_of_value]
    bound = top_p * p.sum()
    return above < bound, np.abs(above - bound)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_the_nucleus_is_the_float64_one_up_to_rounding_and_never_worse_than_mlx_lm(top_p):
    rng = np.random.default_rng(int(top_p * 100))
    ours_off = mlx_off = covered = wide = 0
    for scale in (1.0, 2.0, 3.0, 4.0, 6.0, 10.0):  # nuclei of a few tokens to thousands
        logprobs = _rows(rng, 8, scale)
        ours = np.isfinite(np.array(nucleus(logprobs, top_p)))
        theirs = np.isfinite(np.array(apply_top_p(logprobs, top_p)))
        for r, row in enumerate(np.array(logprobs)):
            kept, distance = _oracle_keeps(row, top_p)
            wrong = ours[r] != kept
            if kept.sum() <= NUCLEUS_CANDIDATES - 40:  # within the candidates, ties and all
                covered += 1
                assert (distance[wrong] < ROUNDING).all(), "a token far from the boundary moved"
            elif kept.sum() > NUCLEUS_CANDIDATES:
                wide += 1
            ours_off += int(wrong.sum())
            mlx_off += int((theirs[r] != kept).sum())
    assert covered >= 10 and wide >= 5
    assert ours_off <= mlx_off


def test_a_row_wider_than_the_candidates_takes_mlx_lms_full_sort(monkeypatch):
    logprobs = _rows(np.random.default_rng(7), 4, 0.5)  # flat: thousands of tokens hold p
    assert int(np.isfinite(np.array(apply_top_p(logprobs, 0.9))).sum(axis=1).min()) \
        > NUCLEUS_CANDIDATES
    want = np.array(apply_top_p(logprobs, 0.9))
    np.testing.assert_array_equal(np.array(nucleus(logprobs, 0.9)), want)
    # a mixed batch: covered rows and wide ones in one call
    mixed = mx.concatenate([_rows(np.random.default_rng(8), 2, 6.0), logprobs[:2]])
    got = np.array(nucleus(mixed, 0.9))
    np.testing.assert_array_equal(got[2:], want[:2])
    # without the fallback, the wide rows are cut to the candidates: the check above fails
    monkeypatch.setattr(sampling.np, "flatnonzero", lambda _: np.zeros(0, dtype=np.int64))
    cut = np.array(nucleus(logprobs, 0.9))
    assert not np.array_equal(cut, want)
    assert (np.isfinite(cut).sum(axis=1) <= NUCLEUS_CANDIDATES + 40).all()


def test_draws_on_a_real_vocabulary_follow_the_oracle():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(VOCAB).astype(np.float32)
    logits[:30] += 10.0  # thirty likely tokens hold about 95% of the mass, a long tail the rest
    params = SamplingParams(temperature=0.7, top_p=0.9)
    expected = oracle_distribution(logits, params)
    kept = expected > 0
    assert 1 < kept.sum() <= NUCLEUS_CANDIDATES
    draws = 4000
    rows = [SamplingRow(params, [], new_key(11, i)) for i in range(draws)]
    tokens, _ = sample_rows(mx.broadcast_to(mx.array(logits), (draws, VOCAB)), rows)
    counts = np.bincount(np.array(tokens), minlength=VOCAB)
    assert counts[~kept].sum() == 0, "a token outside the nucleus was drawn"
    expect = expected[kept] * draws
    chi2 = float(((counts[kept] - expect) ** 2 / expect).sum())
    assert chi2 < chi2_quantile(int(kept.sum()) - 1)


def test_the_candidates_hold_exactly_the_nucleus_or_say_they_do_not():
    """``nucleus_candidates`` (what a speculative verification samples from on the CPU):
    where it says a row's nucleus lies wholly among its candidates, their kept tokens are
    exactly the tokens ``nucleus`` keeps; it says so for peaked rows, and not for a flat row
    or for one whose threshold ties with tokens outside the candidates."""
    rng = np.random.default_rng(12)
    peaked = _rows(rng, 6, 6.0)
    flat = _rows(rng, 1, 0.5)
    tied = np.zeros((1, VOCAB), dtype=np.float32)
    tied[0, 5] = np.log(VOCAB)  # half the mass, then 49k equal tokens: the nucleus needs some
    tied = mx.array(tied) - mx.logsumexp(mx.array(tied), axis=-1, keepdims=True)
    rows = mx.concatenate([peaked, flat, tied])
    kept, ids, inside = sampling.nucleus_candidates(rows, 0.9)
    want = np.isfinite(np.array(nucleus(rows, 0.9)))
    kept, ids, inside = np.array(kept), np.array(ids), np.array(inside)
    assert inside.tolist() == [True] * 6 + [False, False]
    for r in range(6):
        assert len(set(ids[r].tolist())) == NUCLEUS_CANDIDATES
        got = np.zeros(VOCAB, dtype=bool)
        got[ids[r][np.isfinite(kept[r])]] = True
        np.testing.assert_array_equal(got, want[r])
        np.testing.assert_array_equal(kept[r][np.isfinite(kept[r])],
                                      np.array(rows)[r][ids[r][np.isfinite(kept[r])]])
