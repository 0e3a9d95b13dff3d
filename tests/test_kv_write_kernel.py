"""The pool's write kernels on CUDA (shaders/kv_write.cu): ``kv_quantize`` and the in-place stores.

The kernel must store the bytes ``engine.kv.int8.quantize`` stores (the pool's definition,
itself checked bit for bit against a float64 oracle in tests/test_kv8.py). The CPU emulator
runs the very source text (tests/kernel_emulation/cuda_generator.py) over K/V rows that
exercise the corners (ties that round half to even, a scale that underflows fp16 to zero, a
subnormal fp16 scale whose quotients need the clip, an outlier, zeros, huge values), every
head dim and row dtype, a grid that does not fill its last block; planted bugs (rounding half
away from zero, the clip dropped, the fp32 scale dividing where the fp16 one is stored, a
shortened max butterfly, V's scales written into K's, the last warp's item dropped) compile
and are caught. ``-m cuda``: the same comparison on an NVIDIA GPU (scripts/gpu/check.sh).
Also here: the MLX formulation's compiled pair (``int8.quantize_kv``), which every other
backend writes with, against the same oracle.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import kv_write
from engine.kv import int8
from engine.kv.pool import KVPool, KVShape
from tests.kernel_emulation import cuda_generator as cgen
from tests.kernel_emulation import generator as gen
from tests.test_kv8 import kv_samples, oracle_quantize

_EMULATION, _WHY_NOT = gen.emulation_available()
needs_gxx = pytest.mark.skipif(not _EMULATION, reason=_WHY_NOT)
needs_cuda = pytest.mark.skipif(not mx.cuda.is_available(),
                                reason="needs MLX's CUDA backend (an NVIDIA GPU)")


def corner_rows(head_dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V rows [rows, kv_heads, head_dim] float32: kv_samples' corners (ties, zeros, an
    underflowing scale, an outlier, huge values) cut or tiled to ``head_dim``, plus a head
    whose fp16 scale is subnormal (max 1e-5: quotients up to ~167 before the clip). 13 rows
    x 3 heads x 2: 78 warps, not a multiple of a block's 8."""
    base = kv_samples(seed)[:12]
    reps = -(-head_dim // base.shape[-1])
    k = np.tile(base, (1, 1, reps))[..., :head_dim].copy()
    k[5, 0, :64] = kv_samples(seed)[5, 0]  # the tie row whole (max 127: scale exactly 1)
    k[5, 0, 64:] = 0.0
    sub = np.random.default_rng(seed).uniform(-1e-5, 1e-5, (1, 3, head_dim)).astype(np.float32)
    sub[0, :, 0] = 1e-5
    k = np.concatenate([k, sub])
    v = np.random.default_rng(seed + 1).standard_normal(k.shape).astype(np.float32)
    v[0] *= 200.0
    return k, v


def expected(keys: mx.array, values: mx.array) -> list[np.ndarray]:
    """The oracle's (k_q, k_scales, v_q, v_scales) for rows as stored in their dtype."""
    out = []
    for x in (keys, values):
        q, s = oracle_quantize(np.array(x.astype(mx.float32)))
        out += [q, s.astype(np.float32)]
    return out


def assert_bytes_equal(got, keys: mx.array, values: mx.array) -> None:
    names = ("k_q", "k_scales", "v_q", "v_scales")
    for name, g, want in zip(names, got, expected(keys, values), strict=True):
        g = np.array(g.astype(mx.float32)) if g.dtype == mx.float16 else np.array(g)
        np.testing.assert_array_equal(g, want, err_msg=name)


def cases():
    for head_dim in kv_write.HEAD_DIMS:
        for dtype in kv_write.ROW_DTYPES:
            yield pytest.param(head_dim, dtype, id=f"d{head_dim}-{dtype}".replace("mlx.core.", ""))


def rows_for(head_dim: int, dtype) -> tuple[mx.array, mx.array]:
    k, v = corner_rows(head_dim, seed=head_dim)
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def test_the_corner_rows_need_what_the_mutants_drop() -> None:
    """The subnormal head's quotients exceed 127 (the clip matters) and the tie row has
    halves (the rounding mode matters): else the planted bugs below would prove nothing."""
    k, _ = corner_rows(64, seed=64)
    s = np.float32(np.float16(np.float32(1e-5) / np.float32(127)))
    assert np.abs(k[-1] / s).max() > 128
    assert (np.abs(k[5, 0, 1:] % 1) == 0.5).all()


@needs_gxx
@pytest.mark.parametrize(("head_dim", "dtype"), list(cases()))
def test_emulated_kernel_stores_the_bytes_of_int8_quantize(head_dim: int, dtype) -> None:
    keys, values = rows_for(head_dim, dtype)
    got = cgen.run_plan(kv_write.plan_quantize(keys, values))[0]
    assert_bytes_equal(got, keys, values)
    # the pool's own definition agrees (its oracle test is tests/test_kv8.py)
    for g, want in zip(got, [*int8.quantize(keys), *int8.quantize(values)], strict=True):
        assert bool(mx.array_equal(g, want))


@needs_gxx
def test_emulated_kernel_on_one_row_and_one_head() -> None:
    keys, values = rows_for(128, mx.bfloat16)
    keys, values = keys[4:5, :1], values[4:5, :1]
    assert_bytes_equal(cgen.run_plan(kv_write.plan_quantize(keys, values))[0], keys, values)


# Planted bugs in shaders/kv_write.cu (old -> new), each must be caught.
WRITE_KERNEL_MUTANTS = {
    "rounds_half_away_from_zero": ("rintf(__fdiv_rn(x[j], d))", "roundf(__fdiv_rn(x[j], d))"),
    "no_clip": ("int8_t(fminf(fmaxf(rintf(__fdiv_rn(x[j], d)), -127.0f), 127.0f))",
                "int8_t(int(rintf(__fdiv_rn(x[j], d))))"),
    "fp32_scale_divides": ("const float s = __half2float(s16);",
                           "const float s = fminf(__fdiv_rn(amax, 127.0f), 65504.0f);"),
    "short_max_butterfly": ("for (int m = 16; m > 0; m >>= 1)", "for (int m = 8; m > 0; m >>= 1)"),
    "v_scales_into_k": ("(is_v ? v_scales : k_scales)[r] = s16;", "k_scales[r] = s16;"),
    "last_item_dropped": ("if (item >= 2u * head_rows) {", "if (item + 1u >= 2u * head_rows) {"),
}


def mutated(kernel: str, old: str, new: str) -> dict:
    """The shader file's kernels with ``old`` -> ``new`` in ``kernel``'s body, or else in the
    header all kernels share; the site must occur exactly once there."""
    sources = kv_write.KERNELS.sources()
    body = sources[kernel]
    if body.source.count(old) == 1:
        return {**sources, kernel: dataclasses.replace(body, source=body.source.replace(old, new))}
    assert body.header.count(old) == 1, f"mutation site {old!r} not found exactly once"
    header = body.header.replace(old, new)
    return {name: dataclasses.replace(s, header=header) for name, s in sources.items()}


def mutant_sources(name: str) -> dict:
    return mutated(kv_write.KERNEL, *WRITE_KERNEL_MUTANTS[name])


@needs_gxx
@pytest.mark.parametrize("name", list(WRITE_KERNEL_MUTANTS))
def test_planted_write_kernel_bug_is_caught(name: str) -> None:
    keys, values = rows_for(64, mx.float32)
    plan = kv_write.plan_quantize(keys, values, sources=mutant_sources(name))
    with pytest.raises(AssertionError):
        assert_bytes_equal(cgen.run_plan(plan)[0], keys, values)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(("head_dim", "dtype"), list(cases()))
def test_cuda_kernel_stores_the_bytes_of_the_oracle(head_dim: int, dtype) -> None:
    keys, values = rows_for(head_dim, dtype)
    assert_bytes_equal(kv_write.quantize_kv_cuda(keys, values), keys, values)
    # many rows, as a prefill chunk writes them
    rng = np.random.default_rng(head_dim)
    big = [mx.array(rng.standard_normal((2048, 8, head_dim)).astype(np.float32)).astype(dtype)
           for _ in range(2)]
    assert_bytes_equal(kv_write.quantize_kv_cuda(*big), *big)


@pytest.mark.parametrize("dtype", kv_write.ROW_DTYPES)
def test_compiled_quantize_kv_stores_the_oracles_bytes(dtype) -> None:
    """Every backend but CUDA's kernel path writes with ``int8.quantize_kv``: ``quantize``
    for K and V under ``mx.compile``. Fusing must not change a byte."""
    for head_dim in (64, 128):
        keys, values = rows_for(head_dim, dtype)
        assert_bytes_equal(int8.quantize_kv(keys, values), keys, values)
        # another row count: a second trace of the same function
        assert_bytes_equal(int8.quantize_kv(keys[:3], values[:3]), keys[:3], values[:3])


def test_plan_refuses_rows_the_kernel_cannot_take() -> None:
    x = mx.zeros((2, 2, 64))
    with pytest.raises(ValueError, match="share"):
        kv_write.plan_quantize(x, mx.zeros((2, 2, 128)))
    with pytest.raises(ValueError, match="head_dim"):
        kv_write.plan_quantize(mx.zeros((2, 2, 72)), mx.zeros((2, 2, 72)))
    with pytest.raises(ValueError, match="takes one of"):
        kv_write.plan_quantize(x.astype(mx.int32), x.astype(mx.int32))
    with pytest.raises(ValueError, match="empty"):
        kv_write.plan_quantize(mx.zeros((0, 2, 64)), mx.zeros((0, 2, 64)))


def test_quantize_kv_falls_back_off_cuda() -> None:
    """Off MLX's CUDA backend (or with the kernels off) the MLX formulation writes."""
    keys, values = rows_for(64, mx.float32)
    with mx.stream(mx.cpu):
        assert not kv_write.cuda_kernels_run()
        got = kv_write.quantize_kv(keys, values, use_kernel=kv_write.cuda_kernels_run())
    assert_bytes_equal(got, keys, values)
    assert_bytes_equal(kv_write.quantize_kv(keys, values, use_kernel=False), keys, values)


def test_quantized_rows_go_into_an_8_bit_pool_only() -> None:
    pool = KVPool(KVShape(1, 2, 64, mx.float32), 4, 16)
    rows = int8.quantize_kv(mx.zeros((1, 2, 64)), mx.zeros((1, 2, 64)))
    with pytest.raises(ValueError, match="8-bit pool"):
        pool.write_quantized(0, mx.array([1]), mx.array([0]), *rows)


# ---- the in-place stores (kv_store, kv_store_q8): the engine's write on CUDA's kernel path ----

NUM_BLOCKS, BLOCK_SIZE = 4, 16
#: Rows' slots: across blocks, ragged offsets, a block's last slot, and padding rows in the
#: scratch block (-1: the pool's last), as engine/runner/step_batch.py lays a step out.
SLOT_BLOCKS = (2, 2, 0, 3, -1, 1, 3, -1)
SLOT_OFFSETS = (0, 5, 15, 7, 0, 9, 8, 3)


def random_pool(head_dim: int, dtype, quantized: bool, kv_heads: int = 3) -> KVPool:
    """A one-layer pool whose every slot holds random bytes (so a write that lands in the
    wrong slot, or touches one it should not, changes something the comparison sees)."""
    pool = KVPool(KVShape(1, kv_heads, head_dim, dtype, quantized=quantized), NUM_BLOCKS,
                  BLOCK_SIZE)
    rng = np.random.default_rng(head_dim + 7)
    for arrays in (pool.keys, pool.values):
        a = arrays[0]
        if quantized:
            arrays[0] = mx.array(rng.integers(-127, 128, a.shape).astype(np.int8))
        else:
            arrays[0] = mx.array(rng.standard_normal(a.shape).astype(np.float32)).astype(dtype)
    for arrays in (pool.k_scales, pool.v_scales) if quantized else ():
        arrays[0] = mx.array(rng.uniform(0, 1, arrays[0].shape).astype(np.float16))
    mx.eval(pool.arrays())
    return pool


def store_rows(head_dim: int, dtype, kv_heads: int = 3) -> tuple[mx.array, mx.array]:
    k, v = corner_rows(head_dim, seed=head_dim)
    rows = len(SLOT_BLOCKS)
    # padding rows (the scratch block's) carry the same K/V, as the engine's do
    k, v = k[:rows, :kv_heads].copy(), v[:rows, :kv_heads].copy()
    pad = [i for i, b in enumerate(SLOT_BLOCKS) if b < 0]
    k[pad], v[pad] = k[pad[0]], v[pad[0]]
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def emulate_store(pool: KVPool, keys: mx.array, values: mx.array, sources=None):
    """The store's launch in the emulator, over ``pool``'s layer 0: (attend_scale, the pool's
    arrays as the kernel left them: K, V and an 8-bit pool's scales)."""
    k_scales, v_scales = pool.scales(0)
    plan = kv_write.plan_store(
        keys, values, mx.array(SLOT_BLOCKS, dtype=mx.int32),
        mx.array(SLOT_OFFSETS, dtype=mx.int32), pool.keys[0], pool.values[0],
        mx.array([0.125], dtype=mx.float32), k_scales, v_scales, sources=sources)
    (launch,) = plan
    result = gen.run_launch(launch, gen.resolve_inputs(launch, []), frontend=cgen.FRONTEND)
    return result.outputs[0], [result.written[i] for i in launch.in_place]


def scattered(pool: KVPool, keys: mx.array, values: mx.array) -> list[mx.array]:
    """The reference: the same rows written by ``KVPool.write`` (MLX's scatters; an 8-bit
    pool's rows quantized by ``int8.quantize_kv``, oracle-checked above)."""
    pool.write(0, mx.array(SLOT_BLOCKS, dtype=mx.int32), mx.array(SLOT_OFFSETS, dtype=mx.int32),
               keys, values)
    held = [pool.keys[0], pool.values[0], *pool.scales(0)]
    return [a for a in held if a is not None]


def assert_pools_equal(got: list[mx.array], want: list[mx.array]) -> None:
    for name, g, w in zip(("K", "V", "K scales", "V scales"), got, want, strict=False):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        bits = mx.uint16 if w.dtype in (mx.bfloat16, mx.float16) else w.dtype
        np.testing.assert_array_equal(np.array(g.view(bits)), np.array(w.view(bits)),
                                      err_msg=name)


def store_cases():
    for head_dim in kv_write.HEAD_DIMS:
        yield pytest.param(head_dim, mx.bfloat16, True, id=f"q8-d{head_dim}-bfloat16")
    for dtype in (mx.float16, mx.float32):
        yield pytest.param(128, dtype, True, id=f"q8-d128-{dtype}".replace("mlx.core.", ""))
    for dtype in kv_write.ROW_DTYPES:
        for head_dim in (64, 128):
            yield pytest.param(head_dim, dtype, False,
                               id=f"d{head_dim}-{dtype}".replace("mlx.core.", ""))


@needs_gxx
@pytest.mark.parametrize(("head_dim", "dtype", "quantized"), list(store_cases()))
def test_emulated_store_writes_what_the_scatters_write(head_dim: int, dtype,
                                                       quantized: bool) -> None:
    """Every byte of the pool after the in-place store equals the pool after MLX's scatters:
    the rows' slots hold their (quantized) K/V and scales, every other slot is untouched, and
    the scale comes out as it went in."""
    pool = random_pool(head_dim, dtype, quantized)
    keys, values = store_rows(head_dim, dtype)
    attend_scale, got = emulate_store(pool, keys, values)
    assert np.array(attend_scale).tolist() == [0.125]
    assert_pools_equal(got, scattered(pool, keys, values))


# Planted bugs in the stores (kernel, old -> new), each must be caught.
STORE_MUTANTS = {
    "offset_ignored": (
        None, "return (size_t(b) * size_t(block_size) + size_t(offsets[row])) * kv_heads + head;",
        "return (size_t(b) * size_t(block_size)) * kv_heads + head;"),
    "heads_swapped": (
        kv_write.STORE_Q8, "r / kv_heads, r % kv_heads,", "r % kv_heads, r / kv_heads,"),
    "v_into_k_pool": (
        kv_write.STORE, "const_cast<T*>(is_v ? v_pool : k_pool)", "const_cast<T*>(k_pool)"),
    "v_scales_into_k_pool": (
        kv_write.STORE_Q8, "const_cast<__half*>(is_v ? v_scales : k_scales)[at] = s16;",
        "const_cast<__half*>(k_scales)[at] = s16;"),
    "scale_not_passed_on": (kv_write.STORE, "attend_scale[0] = scale[0];", "(void)scale;"),
    "last_item_dropped": (
        kv_write.STORE_Q8, "if (item >= 2u * head_rows) {", "if (item + 1u >= 2u * head_rows) {"),
}


@needs_gxx
@pytest.mark.parametrize("name", list(STORE_MUTANTS))
def test_planted_store_bug_is_caught(name: str) -> None:
    kernel, old, new = STORE_MUTANTS[name]
    quantized = kernel != kv_write.STORE
    pool = random_pool(64, mx.float32, quantized)
    keys, values = store_rows(64, mx.float32)
    sources = mutated(kernel or kv_write.STORE_Q8, old, new)
    attend_scale, got = emulate_store(pool, keys, values, sources=sources)
    with pytest.raises(AssertionError):
        assert np.array(attend_scale).tolist() == [0.125]
        assert_pools_equal(got, scattered(pool, keys, values))


def test_the_test_pools_are_reproducible_and_hold_a_scratch_block() -> None:
    """The GPU test compares a stored pool with a second ``random_pool`` written by scatters:
    both must start from the same bytes; and the slots name the scratch block (-1, the
    arrays' last, as MLX's negative index does), which the comparisons cover too."""
    assert SLOT_BLOCKS.count(-1) >= 2
    for quantized in (False, True):
        a, b = random_pool(64, mx.bfloat16, quantized), random_pool(64, mx.bfloat16, quantized)
        assert a.keys[0].shape[0] == NUM_BLOCKS + 1
        assert_pools_equal(a.arrays(), b.arrays())


def test_plan_store_refuses_what_the_kernel_cannot_take() -> None:
    pool = KVPool(KVShape(1, 2, 64, mx.float32), 4, 16)
    q8 = KVPool(KVShape(1, 2, 64, mx.float32, quantized=True), 4, 16)
    rows = mx.zeros((3, 2, 64))
    slots = mx.zeros((3,), dtype=mx.int32)
    scale = mx.array([1.0])

    def plan(keys=rows, blocks=slots, p=pool, sc=scale, scales=(None, None)):
        return kv_write.plan_store(keys, keys, blocks, slots, p.keys[0], p.values[0], sc,
                                   *scales)

    assert len(plan()) == 1 and plan()[0].in_place == (4, 5)
    assert plan(p=q8, scales=q8.scales(0))[0].in_place == (4, 5, 6, 7)
    with pytest.raises(ValueError, match="do not hold"):
        plan(keys=mx.zeros((3, 4, 64)))
    with pytest.raises(ValueError, match="pool of"):
        plan(keys=rows.astype(mx.float16))
    with pytest.raises(ValueError, match="8-bit pool"):
        plan(p=q8)
    with pytest.raises(ValueError, match="slot ids"):
        plan(blocks=mx.zeros((2,), dtype=mx.int32))
    with pytest.raises(ValueError, match="slot ids"):
        plan(blocks=mx.zeros((3,), dtype=mx.int64))
    with pytest.raises(ValueError, match="scale"):
        plan(sc=mx.array([1.0, 2.0]))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(("head_dim", "dtype", "quantized"), list(store_cases()))
def test_cuda_store_writes_what_the_scatters_write(head_dim: int, dtype, quantized: bool) -> None:
    """On the GPU: the store's pool equals the scatters' byte for byte, read by an MLX op
    ordered after the store only by the scale it passes on (as the attention kernels are)."""
    pool = random_pool(head_dim, dtype, quantized)
    keys, values = store_rows(head_dim, dtype)
    k_scales, v_scales = pool.scales(0)
    attend_scale = kv_write.store_kv(
        keys, values, mx.array(SLOT_BLOCKS, dtype=mx.int32),
        mx.array(SLOT_OFFSETS, dtype=mx.int32), pool.keys[0], pool.values[0],
        mx.array([0.125], dtype=mx.float32), k_scales, v_scales)
    mx.eval(attend_scale)
    assert np.array(attend_scale).tolist() == [0.125]
    got = [a for a in (pool.keys[0], pool.values[0], k_scales, v_scales) if a is not None]
    reference = random_pool(head_dim, dtype, quantized)  # the same random bytes (seeded)
    assert_pools_equal(got, scattered(reference, keys, values))
