"""The batched sampler against the engine's former per-row sampler (tests/reference.py).

Same logits, seeds and parameters must give exactly the same tokens and the same next keys,
step after step, whatever the mix of greedy and sampled rows in the batch: the batched
inverse-CDF draw over vmapped per-row keys gives each seeded row the token of its own
``mx.random.categorical`` call, and the windows carried on the device give the penalty the
history the per-row sampler reads from a Python list.
"""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

from engine.config import SamplingParams
from engine.sampling import Layout, SamplingRow, draw, new_key, sample_rows
from tests.reference import sample_next

VOCAB = 4096

MIX = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=0.7, seed=2),  # same filters as the row above: one group
    SamplingParams(temperature=1.3, top_p=0.9, seed=3),
    SamplingParams(temperature=0.8, top_k=40, seed=4),
    SamplingParams(temperature=0.9, min_p=0.05, seed=5),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, top_p=0.95, top_k=50, min_p=0.02,
                   repetition_penalty=1.2, seed=6),
    SamplingParams(temperature=0.5, repetition_penalty=0.8, seed=7),
]


#: Tokens that stand out of every row's logits (as a real model's few likely tokens do), so
#: the filters and the penalty decide the outcome.
STRONG = [11, 222, 333, 444, 555, 666, 777, 888]


def random_logits(rng: np.random.Generator, rows: int) -> mx.array:
    x = rng.normal(0.0, 2.0, size=(rows, VOCAB)).astype(np.float32)
    x[:, STRONG] += np.linspace(9.0, 6.0, len(STRONG), dtype=np.float32)
    return mx.array(x)


def history(rng: np.random.Generator) -> list[int]:
    """Recent tokens with the strongest token just outside the penalty's 20-token window
    and the second strongest inside it: the penalty's reach changes the greedy choice."""
    tokens = rng.integers(1000, VOCAB, size=int(rng.integers(22, 40))).tolist()
    tokens[-21] = STRONG[0]
    tokens[-3] = STRONG[1]
    return tokens


def run_both(params: list[SamplingParams], steps: int, seed: int):
    """Sample ``steps`` tokens per row both ways; returns (batched, per-row) token lists."""
    rng = np.random.default_rng(seed)
    histories = [history(rng) for _ in params]
    ref_hist = [list(h) for h in histories]
    keys = [None if p.greedy else new_key(p.seed, 0) for p in params]
    ref_keys = list(keys)
    got: list[list[int]] = [[] for _ in params]
    want: list[list[int]] = [[] for _ in params]
    for _ in range(steps):
        logits = random_logits(rng, len(params))
        rows = [SamplingRow(p, h, k) for p, h, k in zip(params, histories, keys)]
        tokens, keys = sample_rows(logits, rows)
        mx.eval(tokens, [k for k in keys if k is not None])
        for i, t in enumerate(tokens.tolist()):
            got[i].append(t)
            histories[i].append(t)
        for i, p in enumerate(params):
            token, ref_keys[i] = sample_next(logits[i], p, ref_hist[i], ref_keys[i])
            want[i].append(token.item())
            ref_hist[i].append(want[i][-1])
        for k, r in zip(keys, ref_keys):
            assert (k is None) == (r is None)
            if k is not None:
                assert mx.array_equal(k, r).item()
    return got, want


def test_batched_tokens_equal_the_per_row_sampler_for_every_parameter_mix() -> None:
    got, want = run_both(MIX, steps=6, seed=0)
    assert got == want
    assert got[0][0] != got[6][0]  # the penalty changed the greedy choice
    sampled = [row for p, row in zip(MIX, got) if not p.greedy]
    assert len({tuple(r) for r in sampled}) == len(sampled)  # the rows really drew apart


@pytest.mark.parametrize("seed", [1, 2])
def test_all_greedy_and_all_sampled_batches_match_too(seed: int) -> None:
    greedy = [SamplingParams(temperature=0.0)] * 5
    sampled = [SamplingParams(temperature=0.9, top_p=0.9, seed=s) for s in range(5)]
    for params in (greedy, sampled):
        got, want = run_both(params, steps=4, seed=seed)
        assert got == want


def test_a_row_draws_the_same_token_alone_or_inside_any_batch() -> None:
    rng = np.random.default_rng(3)
    logits = random_logits(rng, len(MIX))
    history = list(range(1, 30))
    target = 7  # the row with every filter and a penalty
    alone, _ = sample_rows(logits[target : target + 1],
                           [SamplingRow(MIX[target], history, new_key(MIX[target].seed, 0))])
    for others in ([0, 1, 2], [3, 4, 5, 6, 8], list(range(len(MIX)))):
        order = sorted(set(others) | {target})
        rows = [SamplingRow(MIX[i], history, None if MIX[i].greedy else new_key(MIX[i].seed, 0))
                for i in order]
        tokens, _ = sample_rows(logits[mx.array(order)], rows)
        assert tokens.tolist()[order.index(target)] == alone.item()


APP_DEFAULT = dict(temperature=0.3, top_p=0.9, repetition_penalty=1.15,
                   repetition_context_size=128)


def wide_mix(rows: int) -> list[SamplingParams]:
    """Every kind of row at once: the app's default (seeded, a 128-token window), narrower
    windows, other filters, greedy with and without a penalty."""
    kinds = [
        lambda i: SamplingParams(**APP_DEFAULT, seed=i),
        lambda i: SamplingParams(temperature=0.0),
        lambda i: SamplingParams(temperature=1.2, top_k=30, repetition_penalty=1.4,
                                 repetition_context_size=5, seed=i),
        lambda i: SamplingParams(temperature=0.0, repetition_penalty=1.3),
        lambda i: SamplingParams(temperature=0.8, min_p=0.05, seed=i),
    ]
    return [kinds[i % len(kinds)](1000 + i) for i in range(rows)]


def test_state_carried_between_steps_equals_the_per_row_sampler() -> None:
    """The engine's steady decode: the layout built once, the windows and keys carried on
    the device from step to step (each step's tokens appended to the windows without the
    host), 64 rows over 8 steps: every token and key equals the per-row sampler's, which
    reads the whole history from a Python list and draws with its own categorical call."""
    params = wide_mix(64)
    rng = np.random.default_rng(5)
    histories = [history(rng) + rng.integers(1000, VOCAB, size=150).tolist() for _ in params]
    histories[1] = histories[1][-3:]  # a history shorter than its window
    keys = [None if p.greedy else new_key(p.seed, 0) for p in params]
    rows = [SamplingRow(p, h, k) for p, h, k in zip(params, histories, keys)]
    layout = Layout(rows)
    state = layout.initial_state(rows)
    ref_hist = [list(h) for h in histories]
    ref_keys = list(keys)
    for _ in range(8):
        logits = random_logits(rng, len(params))
        tokens, state = draw(layout, logits, state)
        got = tokens.tolist()
        for i, p in enumerate(params):
            token, ref_keys[i] = sample_next(logits[i], p, ref_hist[i], ref_keys[i])
            assert got[i] == token.item(), f"row {i}"
            ref_hist[i].append(got[i])
        for k, i in enumerate(layout.keyed):
            assert mx.array_equal(state.keys[k], ref_keys[i]).item()
    assert layout.width == 128 and layout.outside is not None


def test_one_draw_per_step_whatever_the_number_of_rows() -> None:
    """The random numbers of a step come from a fixed number of operations (a vmapped split
    and uniform over the seeded rows' keys, one uniform on the shared key), not one call per
    row: the step's graph holds the same few RandomBits nodes for 8 rows as for 64."""
    def random_nodes(rows: int) -> int:
        params = wide_mix(rows)
        rows_ = [SamplingRow(p, [1, 2, 3], None if p.greedy or i % 2 else new_key(p.seed, 0))
                 for i, p in enumerate(params)]
        mx.eval([r.key for r in rows_ if r.key is not None])  # the keys' own making aside
        tokens, _ = sample_rows(random_logits(np.random.default_rng(0), rows), rows_,
                                key=mx.random.key(0))
        out = io.StringIO()
        mx.export_to_dot(out, tokens)
        return out.getvalue().count('label ="RandomBits"')

    assert random_nodes(8) == random_nodes(64) <= 3
