"""The CPU kernel's K/V write (shaders/kv_write_cpu.cpp, ``cpu_kernel.write``) against
``KVPool.write``, the MLX ops every other path writes with: the pools must come out equal
byte for byte, in every storage dtype, since the reference attention and the GPU kernels
read what either wrote (an int8 pool's values and fp16 scales included: ties at .5,
zero heads, scales that underflow fp16 or clip at its maximum). Slots outside the pool are
refused before anything is written; planted bugs in the quantizer are caught."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import cpu_kernel
from engine.kv.pool import SCRATCH_BLOCK, KVPool, KVShape

BLOCKS, BLOCK, KV_HEADS, HEAD_DIM = 12, 8, 3, 64


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    assert cpu_kernel.ready(), "the CPU kernel must build on this machine (g++ is required)"


def _pool(dtype: mx.Dtype, seed: int) -> KVPool:
    """A one-layer pool whose every slot already holds a value (so a stray write shows)."""
    pool = KVPool(KVShape(1, KV_HEADS, HEAD_DIM, mx.float32 if dtype == mx.int8 else dtype,
                          quantized=dtype == mx.int8), BLOCKS, BLOCK)
    gen = np.random.default_rng(seed)
    slots = (BLOCKS + 1) * BLOCK
    blocks = mx.array(np.repeat(np.arange(BLOCKS + 1), BLOCK), dtype=mx.int32)
    offsets = mx.array(np.tile(np.arange(BLOCK), BLOCKS + 1), dtype=mx.int32)
    fill = [mx.array(gen.standard_normal((slots, KV_HEADS, HEAD_DIM), dtype=np.float32))
            .astype(pool.shape.dtype) for _ in range(2)]
    pool.write(0, blocks, offsets, *fill)
    mx.eval(pool.arrays())
    return pool


def _rows(gen: np.random.Generator, count: int) -> np.ndarray:
    """float32 [count, KV_HEADS, HEAD_DIM]: ordinary heads and the quantizer's edge cases."""
    rows = gen.standard_normal((count, KV_HEADS, HEAD_DIM)).astype(np.float32)
    rows *= gen.choice([0.01, 1.0, 30.0], size=(count, KV_HEADS, 1)).astype(np.float32)
    rows[0, 0] = 0.0  # a zero head: scale 0, zeros stored
    rows[0, 1] = 1e-12  # its scale underflows fp16 to 0
    rows[0, 2] = np.float32(1e9) * np.sign(rows[0, 2])  # its scale clips at fp16's maximum
    # exact halves: amax 127 * 0.25 makes the scale 0.25 (exact in fp16), and 0.625 / 0.25
    # is 2.5: round half to even gives 2, 0.875 gives 4, -0.625 gives -2
    rows[1, 0] = gen.choice([0.625, 0.875, -0.625, -0.875, 0.125], size=HEAD_DIM)
    rows[1, 0, 0] = 127 * 0.25
    return rows


def _assert_same_bytes(a: KVPool, b: KVPool) -> None:
    for x, y in zip(a.arrays(), b.arrays(), strict=True):
        mx.eval(x, y)
        assert np.array_equal(np.asarray(memoryview(x.view(mx.uint8))),
                              np.asarray(memoryview(y.view(mx.uint8))))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16, mx.int8])
def test_the_kernel_writes_what_the_mlx_ops_write(dtype):
    gen = np.random.default_rng(3)
    count = 11
    slots = gen.choice(BLOCKS * BLOCK, size=count - 2, replace=False)
    blocks = np.append(slots // BLOCK, [SCRATCH_BLOCK, SCRATCH_BLOCK]).astype(np.int32)
    offsets = np.append(slots % BLOCK, [0, 5]).astype(np.int32)
    keys, values = (mx.array(_rows(gen, count)).astype(mx.float32 if dtype == mx.int8 else dtype)
                    for _ in range(2))
    by_mlx, by_kernel = _pool(dtype, 1), _pool(dtype, 1)
    by_mlx.write(0, mx.array(blocks), mx.array(offsets), keys, values)
    cpu_kernel.write(by_kernel.keys[0], by_kernel.values[0], *by_kernel.scales(0), keys, values,
                     blocks, offsets)
    _assert_same_bytes(by_mlx, by_kernel)
    untouched = _pool(dtype, 1)  # and the write did change the pool
    assert not np.array_equal(np.array(untouched.keys[0].astype(mx.float32)),
                              np.array(by_kernel.keys[0].astype(mx.float32)))


def test_a_strided_view_of_the_rows_is_written_as_its_values():
    keys = mx.array(np.random.default_rng(4).standard_normal((KV_HEADS, 3, HEAD_DIM),
                                                             dtype=np.float32))
    strided = keys.transpose(1, 0, 2)  # [3, KV_HEADS, HEAD_DIM], not row-major
    blocks, offsets = np.array([0, 1, 2], dtype=np.int32), np.zeros(3, dtype=np.int32)
    by_mlx, by_kernel = _pool(mx.int8, 2), _pool(mx.int8, 2)
    by_mlx.write(0, mx.array(blocks), mx.array(offsets), strided, strided)
    cpu_kernel.write(by_kernel.keys[0], by_kernel.values[0], *by_kernel.scales(0), strided,
                     strided, blocks, offsets)
    _assert_same_bytes(by_mlx, by_kernel)


@pytest.mark.parametrize("block, offset", [(BLOCKS + 1, 0), (-(BLOCKS + 2), 0), (0, BLOCK),
                                           (0, -1)])
def test_a_slot_outside_the_pool_is_refused_and_nothing_is_written(block, offset):
    pool, before = _pool(mx.int8, 5), _pool(mx.int8, 5)
    rows = mx.ones((2, KV_HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_kernel.write(pool.keys[0], pool.values[0], *pool.scales(0), rows, rows,
                         np.array([1, block], dtype=np.int32),
                         np.array([0, offset], dtype=np.int32))
    _assert_same_bytes(before, pool)


PLANTED = {
    "rounding toward zero": ("std::nearbyint(x[d] / div)", "std::trunc(x[d] / div)"),
    "ties rounded away from zero": ("std::nearbyint(x[d] / div)", "std::round(x[d] / div)"),
    "dividing by the scale before fp16 rounds it": (
        "const float s = static_cast<float>(s16);", "const float s = amax / kQmax;"),
    "a scale stored at the wrong head": ("const int64_t s = slot * kv_heads + h;",
                                         "const int64_t s = slot * kv_heads;"),
    "no clip at 127": ("r = std::fmin(std::fmax(r, -kQmax), kQmax);", ""),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_bugs_in_the_quantizer_are_caught(bug, tmp_path, monkeypatch):
    old, new = PLANTED[bug]
    source = cpu_kernel.WRITE_SOURCE_PATH.read_text()
    assert source.count(old) == 1, f"the plant site of {bug!r} moved"
    planted = tmp_path / "kv_write_cpu.cpp"
    planted.write_text(source.replace(old, new))
    monkeypatch.setenv("PAGEDCHAT_KERNEL_CACHE", str(tmp_path / "cache"))
    library = cpu_kernel.build(write_source_path=Path(planted))
    gen = np.random.default_rng(6)
    blocks = np.arange(6, dtype=np.int32)
    offsets = np.array([0, 3, 7, 1, 2, 4], dtype=np.int32)
    keys = mx.array(_rows(gen, 6))
    by_mlx, by_kernel = _pool(mx.int8, 7), _pool(mx.int8, 7)
    by_mlx.write(0, mx.array(blocks), mx.array(offsets), keys, keys)
    cpu_kernel.write(by_kernel.keys[0], by_kernel.values[0], *by_kernel.scales(0), keys, keys,
                     blocks, offsets, library=library)
    with pytest.raises(AssertionError):
        _assert_same_bytes(by_mlx, by_kernel)
