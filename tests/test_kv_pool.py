"""The pool is written in place: a decode step never copies it, whatever its size."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import blocks_for_budget
from engine.kv.block_table import BlockTable
from engine.kv.blocks import BlockAllocator
from engine.kv.pool import KVPool, KVShape
from engine.runner.architecture import probe_kv_shape
from engine.runner.model_adapter import PagedModel
from engine.runner.step_batch import build_step_batch
from engine.sched.work import SequenceWork
from tests.test_architectures import tiny_model


def buffer_address(a: mx.array) -> int:
    return np.asarray(memoryview(a)).ctypes.data


def pool_addresses(pool: KVPool) -> list[int]:
    return [buffer_address(a) for a in pool.keys + pool.values]


def run_decode_steps(model, num_blocks: int, steps: int = 4) -> tuple[KVPool, list[int], int]:
    """Prefill one prompt, then decode; returns the pool, its buffer addresses before the
    decode steps, and the peak memory those steps added over the pool itself."""
    pool = KVPool(probe_kv_shape(model), num_blocks, 8)
    alloc = BlockAllocator(num_blocks, 8)
    paged = PagedModel(model, pool)
    table = BlockTable(owner="s")

    def feed(tokens: list[int]) -> None:
        start = table.num_tokens
        slots = alloc.append(table, tokens).slots
        mx.eval(paged.forward(build_step_batch([SequenceWork(tokens, start, table.blocks, slots)])))
        alloc.mark_computed(table)

    feed(list(range(1, 12)))
    before = pool_addresses(pool)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for t in range(steps):
        feed([20 + t])
    return pool, before, mx.get_peak_memory() - base


@pytest.mark.parametrize("num_blocks", [64, 8192])
def test_decode_steps_write_the_pool_in_place(num_blocks: int) -> None:
    model = tiny_model("llama")
    pool, before, extra_peak = run_decode_steps(model, num_blocks)
    assert pool_addresses(pool) == before, "a step moved the pool: it was copied"
    # A hidden whole-pool copy would need at least one more layer's array at once.
    one_layer = pool.keys[0].nbytes
    assert extra_peak < max(one_layer, 4 * 2**20), (extra_peak, one_layer)


def test_the_in_place_check_catches_a_second_reference() -> None:
    """Holding a view of a layer's array forces MLX to copy: the check above sees it."""
    pool = KVPool(KVShape(2, 2, 16, mx.float32), 256, 8)
    view = pool.keys[0].reshape(-1)
    mx.eval(view)
    before = pool_addresses(pool)
    idx = mx.array([3], dtype=mx.int32)
    pool.write(0, idx, idx, mx.ones((1, 2, 16)), mx.ones((1, 2, 16)))
    mx.eval(pool.keys, pool.values)
    assert pool_addresses(pool)[0] != before[0]


def test_copy_blocks_copies_every_layer() -> None:
    pool = KVPool(KVShape(3, 2, 16, mx.float32), 8, 4)
    for layer in range(3):
        pool.keys[layer][2] = mx.full((4, 2, 16), float(layer + 1))
        pool.values[layer][2] = mx.full((4, 2, 16), -float(layer + 1))
    mx.eval(pool.keys, pool.values)
    before = pool_addresses(pool)
    pool.copy_blocks([(2, 5)])
    for layer in range(3):
        assert mx.array_equal(pool.keys[layer][5], pool.keys[layer][2]).item()
        assert mx.array_equal(pool.values[layer][5], pool.values[layer][2]).item()
    assert pool_addresses(pool) == before


def test_budget_sizes_the_pool() -> None:
    shape = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype=mx.float32)
    # 30 layers * 2 (K, V) * 3 heads * 64 dims * 4 bytes = 46,080 bytes per token.
    assert blocks_for_budget(shape.bytes_per_token(), 16, 45.0) == (45 * 2**20) // (46_080 * 16)
