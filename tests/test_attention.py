"""Reference paged attention against a naive attention over the same tokens laid out
contiguously (numpy, float64)."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from engine.attention.dispatch import reference_decode, reference_prefill


def naive_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """q: [H, L, D] for the last L positions of k, v: [KVH, T, D]; causal."""
    heads, length, _ = q.shape
    group = heads // k.shape[0]
    total = k.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for h in range(heads):
        kh, vh = k[h // group].astype(np.float64), v[h // group].astype(np.float64)
        for i in range(length):
            visible = total - length + i + 1
            s = (kh[:visible] @ q[h, i].astype(np.float64)) * scale
            p = np.exp(s - s.max())
            out[h, i] = (p / p.sum()) @ vh[:visible]
    return out


def scattered_pool(rng: random.Random, lengths: list[int], block_size: int, kv_heads: int,
                   head_dim: int, spare: int = 7):
    """A pool holding each sequence's tokens in shuffled blocks; returns the pool arrays,
    block tables and each sequence's contiguous K/V."""
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per_seq) + spare
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    k_pool = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(
        (num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    v_pool = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(
        k_pool.shape).astype(np.float32)
    tables, contiguous = [], []
    for n, nb in zip(lengths, blocks_per_seq, strict=True):
        table = [ids.pop() for _ in range(nb)]
        tables.append(table)
        k = k_pool[table].reshape(nb * block_size, kv_heads, head_dim)[:n].transpose(1, 0, 2)
        v = v_pool[table].reshape(nb * block_size, kv_heads, head_dim)[:n].transpose(1, 0, 2)
        contiguous.append((k, v))
    return k_pool, v_pool, tables, contiguous


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_decode_matches_naive_attention(block_size: int, heads: int, kv_heads: int,
                                        attention_formulation) -> None:
    rng = random.Random(block_size * 100 + heads)
    lengths = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 70]
    head_dim = 32
    k_pool, v_pool, tables, contiguous = scattered_pool(rng, lengths, block_size, kv_heads,
                                                        head_dim)
    width = max(map(len, tables))
    padded = [t + [rng.randrange(k_pool.shape[0])] * (width - len(t)) for t in tables]
    q = np.random.default_rng(1).standard_normal((len(lengths), heads, 1, head_dim))
    q = q.astype(np.float32)
    scale = head_dim**-0.5
    out = reference_decode(mx.array(q), mx.array(k_pool), mx.array(v_pool),
                           mx.array(padded, dtype=mx.int32),
                           mx.array(lengths, dtype=mx.int32), scale)
    out = np.array(out)
    for i, (k, v) in enumerate(contiguous):
        expect = naive_attention(q[i], k, v, scale)
        np.testing.assert_allclose(out[i], expect, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk,earlier", [(1, 0), (7, 0), (16, 16), (9, 23), (40, 37)])
def test_prefill_chunk_is_causal_inside_and_full_over_earlier_blocks(
        chunk: int, earlier: int, attention_formulation) -> None:
    rng = random.Random(chunk * 7 + earlier)
    heads, kv_heads, head_dim, block_size = 6, 3, 16, 8
    total = earlier + chunk
    k_pool, v_pool, tables, contiguous = scattered_pool(rng, [total], block_size, kv_heads,
                                                        head_dim)
    q = np.random.default_rng(2).standard_normal((1, heads, chunk, head_dim)).astype(np.float32)
    scale = 0.3
    out = reference_prefill(mx.array(q), mx.array(k_pool), mx.array(v_pool),
                            mx.array(tables[0], dtype=mx.int32), total, scale)
    k, v = contiguous[0]
    np.testing.assert_allclose(np.array(out)[0], naive_attention(q[0], k, v, scale),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("chunk,earlier,most_rows", [(1, 0, 1), (9, 23, 9), (40, 37, 40),
                                                      (40, 37, 14), (64, 200, 16)])
def test_gathered_prefill_masks_the_padded_table_and_matches_naive_attention(
        heads: int, kv_heads: int, chunk: int, earlier: int, most_rows: int,
        monkeypatch) -> None:
    """CUDA's path for long chunks (``gathered_prefill``): the table padded past the sequence
    with other blocks (the engine pads with block 0), nothing sliced to the context, the
    query tokens in tiles of at most ``most_rows`` (40 tokens: 4 tiles of 10; 64: 4 of 16);
    equal to the float64 oracle."""
    from engine.attention import dispatch

    rng = random.Random(chunk * 31 + earlier + heads)
    head_dim, block_size = 16, 8
    total = earlier + chunk
    k_pool, v_pool, tables, contiguous = scattered_pool(rng, [total], block_size, kv_heads,
                                                        head_dim, spare=9)
    table = tables[0] + [0, rng.randrange(k_pool.shape[0]), 0][: 1 + len(tables[0]) // 4]
    width = len(table) * block_size
    # the tile halves from the whole chunk until its scores fit this budget
    monkeypatch.setattr(dispatch, "GATHERED_SCORES", most_rows * heads * width)
    q = np.random.default_rng(3).standard_normal((1, heads, chunk, head_dim)).astype(np.float32)
    out = dispatch.gathered_prefill(mx.array(q), mx.array(k_pool), mx.array(v_pool),
                                    mx.array(table, dtype=mx.int32), total, 0.3)
    k, v = contiguous[0]
    np.testing.assert_allclose(np.array(out)[0], naive_attention(q[0], k, v, 0.3),
                               atol=2e-5, rtol=1e-4)


def test_gathered_prefill_on_an_int8_pool_equals_the_reference_path() -> None:
    """The same K/V bytes and scales: ``gathered_prefill`` and ``reference_prefill`` read an
    8-bit pool alike (dequantized in the gathering)."""
    from engine.attention.dispatch import gathered_prefill
    from engine.kv import int8

    rng = random.Random(5)
    k_pool, v_pool, tables, _ = scattered_pool(rng, [70], 16, 2, 32, spare=4)
    kq, ks = int8.quantize(mx.array(k_pool))
    vq, vs = int8.quantize(mx.array(v_pool))
    q = mx.array(np.random.default_rng(4).standard_normal((1, 6, 21, 32)).astype(np.float32))
    table = mx.array(tables[0] + [0], dtype=mx.int32)
    out = gathered_prefill(q, kq, vq, table, 70, 0.25, k_scales=ks, v_scales=vs)
    ref = reference_prefill(q, kq, vq, table, 70, 0.25, k_scales=ks, v_scales=vs)
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=2e-5, rtol=1e-4)


def test_gathered_prefill_reads_the_steps_own_chunk_tables() -> None:
    """The tables ``build_step_batch`` gives its prompt chunks (padded with block 0 to a
    bucket of width, block 0 holding other data) through ``gathered_prefill`` equal the
    reference path sliced to each chunk's context, chunk by chunk, beside decode rows."""
    from engine.attention.dispatch import gathered_prefill
    from engine.runner.step_batch import build_step_batch
    from engine.sched.work import SequenceWork

    block_size, kv_heads, head_dim, heads = 8, 2, 16, 6
    rng = np.random.default_rng(7)
    k_pool = mx.array(rng.standard_normal((64, block_size, kv_heads, head_dim)), mx.float32)
    v_pool = mx.array(rng.standard_normal(k_pool.shape), mx.float32)

    def work(start: int, length: int, first_block: int) -> SequenceWork:
        total = start + length
        blocks = list(range(first_block, first_block + -(-total // block_size)))
        slots = [(blocks[p // block_size], p % block_size) for p in range(start, total)]
        return SequenceWork([1] * length, start, blocks, slots)

    # a decode row, then chunks over 0, 37 and 71 earlier tokens (tables of 5, 9 and 13
    # blocks: buckets 6, 12 and 16)
    works = [work(20, 1, 1), work(0, 40, 5), work(37, 29, 12), work(71, 33, 30)]
    batch = build_step_batch(works)
    assert [len(c.block_table.tolist()) for c in batch.prefills] == [6, 12, 16]
    for chunk, w in zip(batch.prefills, works[1:], strict=True):
        assert chunk.context_len == w.start + len(w.tokens)
        q = mx.array(rng.standard_normal((1, heads, chunk.length, head_dim)), mx.float32)
        got = gathered_prefill(q, k_pool, v_pool, chunk.block_table, chunk.context_len, 0.25)
        want = reference_prefill(q, k_pool, v_pool, mx.array(list(w.blocks), dtype=mx.int32),
                                 chunk.context_len, 0.25)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


def record_attention_shapes(monkeypatch) -> list[tuple[tuple[int, ...], ...]]:
    """Every call to MLX's fused attention from here on, as its (q, k, v, mask) shapes."""
    seen: list[tuple[tuple[int, ...], ...]] = []
    fused = mx.fast.scaled_dot_product_attention

    def recording(q, k, v, *, scale, mask=None, **kw):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(v.shape),
                     tuple(mask.shape) if isinstance(mask, mx.array) else ()))
        return fused(q, k, v, scale=scale, mask=mask, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recording)
    return seen


def test_a_pastes_gathered_chunks_attend_at_the_few_shapes_the_load_built(monkeypatch) -> None:
    """On CUDA every new shape of the fused attention costs a cuDNN graph, so the gathered
    prefill must attend at a small set of shapes, and the load's warm-up must build exactly
    that set: a paste of 1,500 tokens in chunks of every size a step can take (the budget's
    floors and a prompt's last remainder, 64 to 256 tokens) at every context on the way,
    over tables padded as build_step_batch pads them, attends only at shapes the warm-up ran,
    and those are the powers of two (chunk x table blocks)."""
    from engine.attention import dispatch
    from engine.runner.step_batch import bucket

    monkeypatch.setenv("MLX_CUDA_SDPA_CACHE_SIZE", "256")  # the warm-up sets it otherwise
    block_size, kv_heads, head_dim, heads = 8, 2, 16, 4
    rng = np.random.default_rng(11)
    k_pool = mx.array(rng.standard_normal((200, block_size, kv_heads, head_dim)), mx.float32)
    v_pool = mx.array(rng.standard_normal(k_pool.shape), mx.float32)
    shapes = dispatch.gathered_shapes(64, 256, 200, block_size)
    # 3 chunk sizes x tables of 8 (64 tokens) to 256 blocks
    assert shapes == [(n, w) for n in (64, 128, 256) for w in (8, 16, 32, 64, 128, 256)]
    seen = record_attention_shapes(monkeypatch)
    dispatch.warm_gathered_prefill(heads, k_pool, v_pool, shapes, mx.float32)
    warmed = list(seen)
    assert len(warmed) == len(shapes) == len(set(warmed))
    seen.clear()
    context = 0
    for length in [64, 96, 128, 192, 256, 77, 64, 255, 130, 200, 70]:
        context += length
        table = mx.array(list(range(1, -(-context // block_size) + 1))
                         + [0] * (bucket(-(-context // block_size)) - -(-context // block_size)),
                         dtype=mx.int32)
        q = mx.array(rng.standard_normal((1, heads, length, head_dim)), mx.float32)
        out = dispatch.gathered_prefill(q, k_pool, v_pool, table, context, 0.25)
        want = reference_prefill(q, k_pool, v_pool, table[: -(-context // block_size)],
                                 context, 0.25)
        np.testing.assert_allclose(np.array(out), np.array(want), atol=2e-5, rtol=1e-4)
    assert context == 1532
    assert len(seen) == 11 and set(seen) <= set(warmed), set(seen) - set(warmed)
    assert len(set(seen)) < len(seen)  # shapes repeat: 11 chunks, fewer graphs


def test_warming_the_gathered_prefill_follows_the_switch_and_the_models_heads(monkeypatch):
    """The load's warm-up runs only when the gathered path is on and a chunk can reach it,
    over an 8-bit pool too, and reads the query heads from the model's mlx-lm arguments."""
    from types import SimpleNamespace

    from engine.kv.pool import KVPool, KVShape
    from engine.runner import model_adapter
    from engine.runner.architecture import query_heads

    assert query_heads(SimpleNamespace(args=SimpleNamespace(num_attention_heads=9))) == 9
    assert query_heads(SimpleNamespace(args=SimpleNamespace(n_heads=12))) == 12
    assert query_heads(SimpleNamespace()) is None
    monkeypatch.setenv("MLX_CUDA_SDPA_CACHE_SIZE", "256")  # the warm-up sets it otherwise
    pool = KVPool(KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=mx.float32,
                          quantized=True), 16, 8)
    monkeypatch.setattr(model_adapter, "GATHERED_PREFILL_FROM", None)
    assert model_adapter.warm_gathered_prefill(pool, 4, 256, 1000) == 0
    monkeypatch.setattr(model_adapter, "GATHERED_PREFILL_FROM", 64)
    assert model_adapter.warm_gathered_prefill(pool, 4, 32, 1000) == 0  # chunks stay below
    assert model_adapter.warm_gathered_prefill(pool, None, 256, 1000) == 0
    seen = record_attention_shapes(monkeypatch)
    # chunks 64, 128, 256 x tables of 8 (64 tokens) to 16 blocks: the pool's 16 blocks hold
    # no longer sequence than that, though the model's context is 1,000 tokens (125 blocks)
    assert model_adapter.warm_gathered_prefill(pool, 4, 256, 1000) == 3 * 2 == len(seen)
    seen.clear()
    big = KVPool(KVShape(num_layers=1, num_kv_heads=2, head_dim=16, dtype=mx.float32), 200, 8)
    # a pool of 200 blocks: tables of 8 to 128 blocks (1,000 tokens: 125)
    assert model_adapter.warm_gathered_prefill(big, 4, 256, 1000) == 3 * 5 == len(seen)
