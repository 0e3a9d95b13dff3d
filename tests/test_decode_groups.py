"""Decode groups (engine/runner/step_batch.py, docs/ARCHITECTURE.md §3.5): on the reference
attention path a decode row pays for its own context, not the longest one in the step.

References: a float64 naive attention over each sequence's tokens laid out contiguously
(tests/test_attention.py), the same rows attended as one padded group (today's path before
groups), and mlx-lm's own greedy generation on a tiny model.
"""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import engine.runner.step_batch as step_batch
from engine import Engine, EngineConfig, FinishReason, SamplingParams
from engine.attention import dispatch as attention
from engine.kv.pool import KVPool, KVShape
from engine.runner.model_adapter import PagedLayerCache, PagedModel
from engine.runner.step_batch import DecodeGroup, bucket, build_step_batch, decode_groups
from engine.sched.work import SequenceWork
from tests.reference import collect, reference_model
from tests.test_attention import naive_attention, scattered_pool
from tests.tiny_model import budget_mib, greedy_with_margin, make_tiny_model

BLOCK = 8


def _covers(groups: tuple[DecodeGroup, ...], widths: list[int], padding: int) -> None:
    """Groups are contiguous, cover every row once, and each is wide enough for its rows."""
    assert groups[0].start == 0 and groups[-1].stop == len(widths) + padding
    for a, b in zip(groups, groups[1:]):
        assert a.stop == b.start
    for g in groups:
        for row in range(g.start, min(g.stop, len(widths))):
            assert widths[row] <= g.width


def test_short_rows_beside_a_long_one_get_a_group_of_their_own(monkeypatch):
    monkeypatch.setattr(step_batch, "GROUP_CALL_BLOCKS", 8)
    widths = [2, 2, 3, 3, 3, 3, 3, 225]  # seven chats at ~20 tokens, one at 3,600
    groups = decode_groups(widths, padding=0)
    _covers(groups, widths, 0)
    assert groups == (DecodeGroup(0, 7, 3), DecodeGroup(7, 8, bucket(225)))


def test_close_widths_share_one_call(monkeypatch):
    monkeypatch.setattr(step_batch, "GROUP_CALL_BLOCKS", 8)
    # 6, 8 and 12 blocks bucketed: splitting the 8 saves 1 x 4 row-blocks, then the 6 saves
    # 1 x 6: each less than a call
    widths = [6, 7, 9]
    groups = decode_groups(widths, padding=1)
    _covers(groups, widths, 1)
    assert groups == (DecodeGroup(0, 4, 12),)
    monkeypatch.setattr(step_batch, "GROUP_CALL_BLOCKS", 1)  # calls cheap: three of them
    assert decode_groups(widths, padding=1) == (
        DecodeGroup(0, 1, 6), DecodeGroup(1, 2, 8), DecodeGroup(2, 3, 12), DecodeGroup(3, 4, 1))


def test_padding_rows_get_the_narrowest_group_when_rows_split():
    widths = [1, 1, 1, 1, 200]
    groups = decode_groups(widths, padding=1)
    _covers(groups, widths, 1)
    assert groups[-1] == DecodeGroup(5, 6, 1) and len(groups) == 3


@pytest.mark.parametrize("seed", range(6))
def test_any_mix_of_widths_is_covered(seed):
    rng = random.Random(seed)
    widths = sorted(rng.choice([1, 2, 5, 40, 300]) for _ in range(rng.randint(1, 40)))
    padding = bucket(len(widths)) - len(widths)
    _covers(decode_groups(widths, padding), widths, padding)


def _mixed_step(rng: random.Random, lengths: list[int]):
    """A pool holding ``lengths`` sequences and the decode step of each (its last token)."""
    heads, kv_heads, head_dim = 6, 2, 16
    k_pool, v_pool, tables, contiguous = scattered_pool(rng, lengths, BLOCK, kv_heads,
                                                        head_dim)
    pool = KVPool(KVShape(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim,
                          dtype=mx.float32), k_pool.shape[0], BLOCK)
    pool.keys[0] = mx.concatenate([mx.array(k_pool), pool.keys[0][-1:]])
    pool.values[0] = mx.concatenate([mx.array(v_pool), pool.values[0][-1:]])
    works = []
    for n, table in zip(lengths, tables):
        last = n - 1
        works.append(SequenceWork([7], last, table, [(table[last // BLOCK], last % BLOCK)]))
    q = np.random.default_rng(3).standard_normal((len(lengths), heads, 1, head_dim))
    return pool, works, q.astype(np.float32), contiguous


def test_grouped_attention_equals_float64_and_the_padded_path():
    rng = random.Random(11)
    lengths = [30, 9, 3600, 17, 100, 100, 64, 1]  # submitted in any order
    pool, works, q, contiguous = _mixed_step(rng, lengths)
    batch = build_step_batch(works)
    assert len(batch.decode_groups) >= 2, "the mix must split, or this tests nothing"
    cache = PagedLayerCache(pool, 0, use_kernel=False)
    cache.batch = batch
    order = [batch.work_rows.index(row) for row in range(len(works))]  # work of each row
    rows_q = np.concatenate([q[order], np.zeros((batch.padding, *q.shape[1:]), q.dtype)])
    grouped = np.array(cache.attend(mx.array(rows_q), scale=0.25))
    padded = np.array(attention.reference_decode(
        mx.array(rows_q), pool.keys[0], pool.values[0], batch.decode_tables, batch.decode_lens,
        0.25))
    for row, work in enumerate(order):
        k, v = contiguous[work]
        want = naive_attention(q[work], k, v, 0.25)
        np.testing.assert_allclose(grouped[row], want, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(grouped[row], padded[row], atol=2e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama",
                           reference_model().path)


def test_greedy_replies_equal_mlx_lm_when_a_long_chat_decodes_beside_short_ones(
        tiny, monkeypatch):
    groups_seen = []
    real_forward = PagedModel.forward

    def forward(paged, batch):
        groups_seen.append(len(batch.decode_groups))
        return real_forward(paged, batch)

    monkeypatch.setattr(PagedModel, "forward", forward)
    long_prompt = [(17 * i) % 2900 + 11 for i in range(450)]  # context limit 512
    prompts = [long_prompt] + [[(13 * i + 7 * k) % 3000 + 5 for i in range(9 + 3 * k)]
                               for k in range(5)]
    expected = []
    for p in prompts:
        tokens, margin = greedy_with_margin(tiny, p, 20)
        assert margin > 1e-4, "a near-tie in the reference: pick other prompts"
        expected.append(tokens)
    eng = Engine(EngineConfig(model=str(tiny), kv_memory_mib=budget_mib(256, BLOCK),
                              block_size=BLOCK, max_batch=8, prefill_chunk=1024,
                              attention="reference"))
    eng.start()
    try:
        assert eng.wait_ready(120), eng.load_error
        handles = [eng.submit(prompt_tokens=p, params=SamplingParams(temperature=0.0,
                                                                     max_tokens=20))
                   for p in prompts]
        results = [collect(h) for h in handles]
    finally:
        eng.stop()
    for (tokens, finals), want in zip(results, expected):
        assert finals[0].finish_reason is not FinishReason.ERROR, finals[0].error
        assert tokens[0] == want
    assert max(groups_seen) >= 2, "no step split its decode rows: the test exercises nothing"


def test_the_kernel_path_keeps_one_batched_call(monkeypatch):
    """Groups are the reference path's: a kernel reads each row's own blocks already."""
    calls = []
    monkeypatch.setattr(attention, "paged_decode",
                        lambda q, *a, use_kernel, **k: calls.append(q.shape[0]) or q)
    rng = random.Random(5)
    pool, works, q, _ = _mixed_step(rng, [3, 900, 5])
    cache = PagedLayerCache(pool, 0, use_kernel=True)
    cache._kernel_ok = True  # as on a GPU whose kernel fits this shape
    cache.batch = build_step_batch(works)
    assert len(cache.batch.decode_groups) == 2
    cache.attend(mx.zeros((cache.batch.num_decode, 6, 1, 16)), scale=0.25)
    assert calls == [cache.batch.num_decode]


def test_padding_is_kept_for_bucketed_shapes():
    rng = random.Random(2)
    _, works, _, _ = _mixed_step(rng, [3, 900, 5, 7, 9])
    batch = build_step_batch(works)
    assert batch.num_decode == bucket(5) and batch.padding == 1
    assert step_batch.BUCKET_SHAPES


def test_drafts_laid_out_as_decode_rows_attend_as_their_chunk_does_and_as_float64():
    """A work verifying k drafts becomes k + 1 decode rows of one table (the kernel path's
    layout: engine/runner/step_batch.py), the j-th row over the first start + 1 + j tokens.
    Both layouts of one step, the chunk one and the decode one, must attend alike, and each
    row as the float64 oracle over its own causal prefix."""
    rng = random.Random(7)
    heads, head_dim = 6, 16
    lengths = [40, 300, 5, 77]  # each sequence's tokens, its fed ones (and drafts) included
    k_pool, v_pool, tables, contiguous = scattered_pool(rng, lengths, BLOCK, 2, head_dim)
    pool = KVPool(KVShape(num_layers=1, num_kv_heads=2, head_dim=head_dim,
                          dtype=mx.float32), k_pool.shape[0], BLOCK)
    pool.keys[0] = mx.concatenate([mx.array(k_pool), pool.keys[0][-1:]])
    pool.values[0] = mx.concatenate([mx.array(v_pool), pool.values[0][-1:]])
    drafts = [3, 0, 4, 8]  # a plain decode beside three verifying works
    works = []
    for n, table, k in zip(lengths, tables, drafts):
        start = n - 1 - k
        slots = [(table[p // BLOCK], p % BLOCK) for p in range(start, n)]
        works.append(SequenceWork([7] * (k + 1), start, table, slots,
                                  drafts=tuple([7] * k)))
    q = np.random.default_rng(5).standard_normal(
        (sum(d + 1 for d in drafts), heads, 1, head_dim)).astype(np.float32)
    firsts = np.cumsum([0] + [d + 1 for d in drafts])  # each work's queries in q

    outputs = {}
    for as_decodes in (False, True):
        batch = build_step_batch(works, drafts_as_decodes=as_decodes)
        rows_q = np.zeros((batch.tokens.shape[0], heads, 1, head_dim), np.float32)
        for w, row in enumerate(batch.work_rows):
            rows_q[row:row + drafts[w] + 1] = q[firsts[w]:firsts[w + 1]]
        cache = PagedLayerCache(pool, 0, use_kernel=False)
        cache.batch = batch
        out = np.array(cache.attend(mx.array(rows_q), scale=0.25))
        outputs[as_decodes] = [out[row:row + drafts[w] + 1]
                               for w, row in enumerate(batch.work_rows)]
        if as_decodes:
            assert not batch.prefills, "every verifying work must be decode rows"
            assert batch.num_decode == bucket(sum(d + 1 for d in drafts))
            lens = np.array(batch.decode_lens)
            for w, row in enumerate(batch.work_rows):
                start = lengths[w] - 1 - drafts[w]
                assert list(lens[row:row + drafts[w] + 1]) == [
                    start + 1 + j for j in range(drafts[w] + 1)]
        else:
            assert len(batch.prefills) == 3
    for w in range(len(works)):
        keys, values = contiguous[w]
        want = naive_attention(q[firsts[w]:firsts[w + 1], :, 0].swapaxes(0, 1),
                               keys, values, 0.25)  # [H, k + 1, D]: the last k + 1 of n
        got = outputs[True][w][:, :, 0].swapaxes(0, 1)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(got, outputs[False][w][:, :, 0].swapaxes(0, 1),
                                   atol=2e-6, rtol=1e-5)
