"""Stable shapes (docs/ARCHITECTURE.md §3.5): a step's batch and block tables are padded to
buckets, so a steady decode repeats the same shapes (MLX's CUDA graphs and the kernels'
plans are reused), padding rows are inert, and the plan caches are bounded.

References: mlx-lm's own greedy generation (tiny model), the same steps run with exact
shapes, and a fresh pool's zeros for every block no sequence holds.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import engine.runner.step_batch as step_batch
from engine import Engine, EngineConfig, FinishReason, SamplingParams
from engine.attention import dispatch as attention
from engine.attention.plan_cache import PlanCache, plan_key
from engine.attention.plans import Launch, Ref
from engine.kv.block_table import BlockTable
from engine.kv.blocks import BlockAllocator
from engine.kv.pool import KVPool
from engine.runner.architecture import probe_kv_shape
from engine.runner.model_adapter import PagedModel
from engine.runner.step_batch import blas_rows, bucket, build_step_batch
from engine.sched.work import SequenceWork
from tests.reference import collect, reference_model
from tests.test_architectures import tiny_model
from tests.tiny_model import budget_mib, greedy_with_margin, make_tiny_model

BLOCK = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama",
                           reference_model().path)


def test_buckets_cover_every_size_within_half_again_in_few_shapes() -> None:
    sizes = [bucket(n) for n in range(1, 5000)]
    assert all(n <= b <= max(n, 1.5 * n) for n, b in zip(range(1, 5000), sizes))
    assert sizes == sorted(sizes)
    assert len(set(sizes)) <= 2 * 13  # two per doubling
    assert [bucket(n) for n in range(1, 13)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12]


def _prompts(n: int) -> list[list[int]]:
    return [[(13 * i + 7 * k) % 3000 + 5 for i in range(9 + 5 * k)] for k in range(n)]


def _engine(tiny: Path, blocks: int = 256) -> Engine:
    eng = Engine(EngineConfig(model=str(tiny), kv_memory_mib=budget_mib(blocks, BLOCK),
                              block_size=BLOCK, max_batch=16, prefill_chunk=64,
                              # drafting rows are chunks of their own length (ARCHITECTURE
                              # §3.13): this file checks the decode rows' shapes
                              speculative=False))
    eng.start()
    assert eng.wait_ready(120), eng.load_error
    return eng


def _record(monkeypatch) -> tuple[list, list]:
    """Every batch the model runs and every decode attention's plan key."""
    batches, keys = [], []
    real_forward = PagedModel.forward
    real_decode = attention.paged_decode

    def forward(paged, batch):
        batches.append(batch)
        return real_forward(paged, batch)

    def decode(q, k_pool, v_pool, tables, lens, scale, use_kernel):
        keys.append(plan_key(q, k_pool, v_pool, tables, lens))
        return real_decode(q, k_pool, v_pool, tables, lens, scale, use_kernel)

    monkeypatch.setattr(PagedModel, "forward", forward)
    monkeypatch.setattr(attention, "paged_decode", decode)
    return batches, keys


@pytest.mark.parametrize("bucketed", [True, False], ids=["bucketed", "exact"])
def test_greedy_replies_equal_mlx_lm_with_and_without_buckets(tiny, monkeypatch, bucketed):
    monkeypatch.setattr(step_batch, "BUCKET_SHAPES", bucketed)
    batches, _ = _record(monkeypatch)
    prompts = _prompts(5)  # 5 decoding rows: a bucket of 6, one padding row
    expected = []
    for p in prompts:
        tokens, margin = greedy_with_margin(tiny, p, 24)
        assert margin > 1e-4, "a near-tie in the reference: pick other prompts"
        expected.append(tokens)
    eng = _engine(tiny)
    try:
        handles = [eng.submit(prompt_tokens=p, params=SamplingParams(temperature=0.0,
                                                                     max_tokens=24))
                   for p in prompts]
        results = [collect(h) for h in handles]
    finally:
        eng.stop()
    for (tokens, finals), want in zip(results, expected):
        assert finals[0].finish_reason is not FinishReason.ERROR, finals[0].error
        assert tokens[0] == want
    padded = [b for b in batches if b.padding]
    if bucketed:
        assert padded, "no step was padded: the test does not exercise padding rows"
        for b in batches:  # a bucket of decode rows; on the CPU, then the BLAS's row count
            real = b.num_decode - b.padding
            rows = bucket(real) + sum(c.length for c in b.prefills)
            on_cpu = mx.default_device() == mx.cpu
            assert b.tokens.shape[0] == (blas_rows(rows) if on_cpu and real else rows)
    else:
        assert not padded


def test_a_long_decode_of_8_chats_uses_few_plan_keys(tiny, monkeypatch):
    """300 tokens each: the tables grow by 38 blocks, so exact shapes give a key per width
    (50 keys); buckets give one per bucket the batch and the width pass through (16)."""
    counts = {}
    for bucketed in (True, False):
        monkeypatch.setattr(step_batch, "BUCKET_SHAPES", bucketed)
        batches, keys = _record(monkeypatch)
        eng = _engine(tiny, blocks=512)
        try:
            handles = [eng.submit(prompt_tokens=p, params=SamplingParams(temperature=0.0,
                                                                         max_tokens=300))
                       for p in _prompts(8)]
            for h in handles:
                collect(h)
        finally:
            eng.stop()
        counts[bucketed] = len(set(keys))
        widths = {b.decode_tables.shape[1] for b in batches if b.decode_tables is not None}
        rows = {b.num_decode for b in batches if b.num_decode}
        if bucketed:
            longest = max(widths)
            assert set(widths) <= {bucket(n) for n in range(1, longest + 1)}
            # the widths only grow; the batch grows as chats are admitted and shrinks as
            # they end: the keys are a staircase through the bucket grid, up then down
            assert counts[True] <= len(widths) + 2 * len(rows)
    assert counts[True] <= 16 and counts[False] >= 2 * counts[True], counts


def _tiny_paged() -> tuple[KVPool, BlockAllocator, PagedModel, list[BlockTable]]:
    """The tiny llama on a 64-block pool, its allocator, and five empty tables."""
    model = tiny_model("llama")
    pool = KVPool(probe_kv_shape(model), 64, BLOCK)
    paged = PagedModel(model, pool)
    return pool, BlockAllocator(64, BLOCK), paged, [BlockTable(owner=f"s{i}") for i in range(5)]


def _drive(bucketed: bool) -> tuple[KVPool, list[BlockTable]]:
    """Five sequences prefilled together, then 12 decode steps of all five (a bucket of 6:
    one padding row each step), straight through the model adapter."""
    pool, alloc, paged, tables = _tiny_paged()
    feeds = [[(5 * i + 3 * k) % 90 + 1 for i in range(6 + 4 * k)] for k in range(5)]
    for step in range(13):
        works = []
        for t, tokens in zip(tables, feeds):
            start = t.num_tokens
            works.append(SequenceWork(tokens, start, list(t.blocks) + [], []))
            slots = alloc.append(t, tokens).slots
            works[-1] = SequenceWork(tokens, start, list(t.blocks), slots)
        batch = build_step_batch(works, bucketed=bucketed)
        assert batch.padding == (1 if bucketed and step else 0)
        logits = paged.forward(batch)
        mx.eval(logits, pool.keys, pool.values)
        for t in tables:
            alloc.mark_computed(t)
        feeds = [[int(x)] for x in mx.argmax(logits, axis=-1).tolist()]
    return pool, tables


def test_padding_rows_write_only_the_scratch_block():
    exact_pool, exact_tables = _drive(bucketed=False)
    pool, tables = _drive(bucketed=True)
    assert [t.tokens for t in tables] == [t.tokens for t in exact_tables]  # same replies
    held = sorted({b for t in tables for b in t.blocks})
    assert held == sorted({b for t in exact_tables for b in t.blocks})
    n = pool.num_blocks
    for layer in range(len(pool.keys)):
        for arrays, exact in ((pool.keys, exact_pool.keys), (pool.values, exact_pool.values)):
            got, want = np.array(arrays[layer]), np.array(exact[layer])
            # every block a sequence holds: the same K/V as with exact shapes
            np.testing.assert_allclose(got[held], want[held], rtol=1e-5, atol=1e-6)
            # every other block of the allocator: untouched
            free = [b for b in range(n) if b not in held]
            assert not np.any(got[free]), "a padding row wrote into an allocator block"
            # the scratch block (one past the allocator's) took the padding rows
            assert np.any(got[n]) and not np.any(want[n])


def _mixed_step(row_fit) -> tuple[mx.array, KVPool, list[int], object]:
    """Four sequences prefilled, then one step of their four decodes beside a fifth
    sequence's 6-token prompt (10 rows: the CPU's BLAS pads them to 16)."""
    pool, alloc, paged, tables = _tiny_paged()
    feeds = [[(5 * i + 3 * k) % 90 + 1 for i in range(6 + 4 * k)] for k in range(4)]
    feeds.append([(7 * i) % 90 + 2 for i in range(6)])

    def work(t: BlockTable, tokens: list[int]) -> SequenceWork:
        start = t.num_tokens
        slots = alloc.append(t, tokens).slots
        return SequenceWork(tokens, start, list(t.blocks), slots)

    first = build_step_batch([work(t, f) for t, f in zip(tables[:4], feeds[:4])])
    logits = paged.forward(first)
    mx.eval(logits, pool.keys, pool.values)
    for t in tables[:4]:
        alloc.mark_computed(t)
    nexts = [[int(x)] for x in mx.argmax(logits, axis=-1).tolist()]
    works = [work(t, f) for t, f in zip(tables, nexts + [feeds[4]])]
    batch = build_step_batch(works, row_fit=row_fit)
    logits = paged.forward(batch)
    mx.eval(logits, pool.keys, pool.values)
    return logits, pool, sorted({b for t in tables for b in t.blocks}), batch


def test_rows_padded_for_the_blas_change_nothing_but_the_scratch_block():
    want, exact_pool, held, exact = _mixed_step(None)
    got, pool, held_padded, batch = _mixed_step(blas_rows)
    assert exact.tokens.shape[0] == 10 and batch.tokens.shape[0] == 16
    assert batch.padding == 6 and batch.logit_rows.shape[0] == 16  # 5 logits: 6 -> 16
    assert held_padded == held
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    n = pool.num_blocks
    for layer in range(len(pool.keys)):
        for arrays, ref in ((pool.keys, exact_pool.keys), (pool.values, exact_pool.values)):
            np.testing.assert_allclose(np.array(arrays[layer])[held],
                                       np.array(ref[layer])[held], rtol=1e-5, atol=1e-6)
            free = [b for b in range(n) if b not in held]
            assert not np.any(np.array(arrays[layer])[free])


def test_blas_rows_are_whole_tiles_of_16_unless_a_few_rows_past_one():
    rows = (1, 4, 5, 8, 12, 16, 17, 19, 20, 31, 32, 35, 36, 50, 52, 128, 129, 140, 300)
    assert [blas_rows(n) for n in rows] \
        == [1, 4, 16, 16, 16, 16, 17, 19, 32, 32, 32, 35, 48, 50, 64, 128, 129, 140, 300]


class _FakeKernels:
    """Kernel objects that return zeros of the planned shapes (no GPU needed)."""

    def __init__(self) -> None:
        self.built = 0

    def get(self, source):
        self.built += 1

        def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

        return kernel


def test_plan_caches_plan_once_per_shape_and_stay_bounded():
    fake = _FakeKernels()
    cache = PlanCache(fake, size=4)
    planned = []

    def plan_for(x):
        def plan():
            planned.append(x.shape)
            return [Launch("attend", (x,), (), (1, 1, 1), (1, 1, 1), ((x.shape[0], 2),),
                           (mx.float32,)),
                    Launch("reduce", (Ref(0, 0), x), (), (1, 1, 1), (1, 1, 1),
                           ((x.shape[0],),), (mx.float32,))]
        return plan

    for _step in range(3):
        for n in range(1, 7):  # six shapes, four kept
            x = mx.ones((n,))
            out = cache.run((n,), (x,), plan_for(x))
            assert out.shape == (n,)
    assert len(cache) == 4 and cache.keys() == [(3,), (4,), (5,), (6,)]
    assert len(planned) == 18  # LRU over a cycle of six: every call misses at size 4
    planned.clear()
    for _ in range(50):  # a steady decode: one key, planned once
        x = mx.ones((6,))
        cache.run((6,), (x,), plan_for(x))
    assert planned == []


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_the_kernel_paths_plan_once_per_shape_not_per_layer(monkeypatch, backend):
    if backend == "metal":
        import engine.attention.metal as module

        def call(*args):
            return module.paged_decode_kernel(*args)

        planner = "plan_decode"
    else:
        import engine.attention.cuda as module

        def call(*args):
            return module.paged_decode_cuda(*args)

        planner = "plan_attention"
    fake = _FakeKernels()
    monkeypatch.setattr(module, "PLANS", PlanCache(fake))
    real = getattr(module, planner)
    plans = []
    monkeypatch.setattr(module, planner, lambda *a, **k: plans.append(1) or real(*a, **k))
    pool = mx.zeros((33, BLOCK, 2, 64))
    for _layer in range(2 * 30):  # two steps of a 30-layer model, same bucketed shapes
        q = mx.zeros((6, 4, 1, 64))
        tables = mx.zeros((6, 8), dtype=mx.int32)
        lens = mx.ones((6,), dtype=mx.int32)
        out = call(q, pool, pool, tables, lens, 0.125)
        assert out.shape == (6, 4, 1, 64)
    assert len(plans) == 1
