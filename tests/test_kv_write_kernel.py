"""The 8-bit pool's write kernel on CUDA (``kv_quantize``, shaders/kv_write.cu; issue #26).

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

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import kv_quantize
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
    for head_dim in kv_quantize.HEAD_DIMS:
        for dtype in kv_quantize.ROW_DTYPES:
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
    got = cgen.run_plan(kv_quantize.plan_quantize(keys, values))[0]
    assert_bytes_equal(got, keys, values)
    # the pool's own definition agrees (its oracle test is tests/test_kv8.py)
    for g, want in zip(got, [*int8.quantize(keys), *int8.quantize(values)], strict=True):
        assert bool(mx.array_equal(g, want))


@needs_gxx
def test_emulated_kernel_on_one_row_and_one_head() -> None:
    keys, values = rows_for(128, mx.bfloat16)
    keys, values = keys[4:5, :1], values[4:5, :1]
    assert_bytes_equal(cgen.run_plan(kv_quantize.plan_quantize(keys, values))[0], keys, values)


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


def mutant_sources(name: str) -> dict:
    old, new = WRITE_KERNEL_MUTANTS[name]
    text = kv_quantize.WRITE_SHADER_PATH.read_text()
    assert text.count(old) == 1, f"mutation site of {name!r} not found exactly once"
    return kv_quantize.KERNELS.parse(text.replace(old, new))


@needs_gxx
@pytest.mark.parametrize("name", list(WRITE_KERNEL_MUTANTS))
def test_planted_write_kernel_bug_is_caught(name: str) -> None:
    keys, values = rows_for(64, mx.float32)
    plan = kv_quantize.plan_quantize(keys, values, sources=mutant_sources(name))
    with pytest.raises(AssertionError):
        assert_bytes_equal(cgen.run_plan(plan)[0], keys, values)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(("head_dim", "dtype"), list(cases()))
def test_cuda_kernel_stores_the_bytes_of_the_oracle(head_dim: int, dtype) -> None:
    keys, values = rows_for(head_dim, dtype)
    assert_bytes_equal(kv_quantize.quantize_kv_cuda(keys, values), keys, values)
    # many rows, as a prefill chunk writes them
    rng = np.random.default_rng(head_dim)
    big = [mx.array(rng.standard_normal((2048, 8, head_dim)).astype(np.float32)).astype(dtype)
           for _ in range(2)]
    assert_bytes_equal(kv_quantize.quantize_kv_cuda(*big), *big)


@pytest.mark.parametrize("dtype", kv_quantize.ROW_DTYPES)
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
        kv_quantize.plan_quantize(x, mx.zeros((2, 2, 128)))
    with pytest.raises(ValueError, match="head_dim"):
        kv_quantize.plan_quantize(mx.zeros((2, 2, 72)), mx.zeros((2, 2, 72)))
    with pytest.raises(ValueError, match="takes one of"):
        kv_quantize.plan_quantize(x.astype(mx.int32), x.astype(mx.int32))
    with pytest.raises(ValueError, match="empty"):
        kv_quantize.plan_quantize(mx.zeros((0, 2, 64)), mx.zeros((0, 2, 64)))


def test_quantize_kv_falls_back_off_cuda() -> None:
    """Off MLX's CUDA backend (or with the kernels off) the MLX formulation writes."""
    keys, values = rows_for(64, mx.float32)
    with mx.stream(mx.cpu):
        got = kv_quantize.quantize_kv(keys, values, use_kernel=True)
    assert_bytes_equal(got, keys, values)


def test_quantized_rows_go_into_an_8_bit_pool_only() -> None:
    pool = KVPool(KVShape(1, 2, 64, mx.float32), 4, 16)
    rows = int8.quantize_kv(mx.zeros((1, 2, 64)), mx.zeros((1, 2, 64)))
    with pytest.raises(ValueError, match="8-bit pool"):
        pool.write_quantized(0, mx.array([1]), mx.array([0]), *rows)
