"""The compiled CPU attention kernel (engine/attention/cpu_kernel.py,
shaders/paged_attention_cpu.cpp) against a float64 oracle.

* The oracle reads the same pool (bf16 / fp16 values are exact in float64; int8 as q * s,
  the pool's own dequantization) and attends each query to its causal prefix.
* Shape matrix: grouped-query ratios 1-8, head dims 32-128, block sizes 8/16/32, ragged
  decode rows beside prompt chunks (and bucket padding rows) in one call, float32, bfloat16,
  float16 and int8 pools; a call large enough to split over threads equals its one-thread run.
* Planted bugs in copies of the source are caught, on both ways of reading V (in place, and
  widened into a tile): a causal mask one token late, a missing rescale, K transposed into
  the wrong lanes, int8 K without its scales, V read with K's scales, V read at the wrong
  stride or from the wrong token, heads of one KV head mapped wrongly, bfloat16 widened
  wrongly.
* The engine on the embedded model reports the kernel and gives mlx-lm's greedy replies;
  where the kernel cannot be built it keeps the MLX formulation.
"""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.attention import cpu_kernel
from engine.kv import int8
from engine.runner.step_batch import build_step_batch
from engine.sched.work import SequenceWork
from tests.reference import chat_prompt, collect, greedy_reference


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    assert cpu_kernel.ready(), "the CPU kernel must build on this machine (g++ is required)"


def _pool(rng: random.Random, lengths: list[int], block: int, kv_heads: int, head_dim: int,
          dtype: mx.Dtype):
    """A pool holding each sequence in shuffled blocks: (k, v, k_scales, v_scales, tables,
    k64, v64) with the float64 values the oracle reads, [num_blocks, block, kvh, D]."""
    need = sum(-(-n // block) for n in lengths) + 3
    ids = list(range(need))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-n // block))] for n in lengths]
    gen = np.random.default_rng(rng.randrange(1 << 30))
    raw = [gen.standard_normal((need, block, kv_heads, head_dim)).astype(np.float32)
           * np.float32(1.5) for _ in range(2)]
    if dtype == mx.int8:
        parts = [int8.quantize(mx.array(x)) for x in raw]
        (kq, ks), (vq, vs) = parts
        k64 = np.array(kq).astype(np.float64) * np.array(ks).astype(np.float64)[..., None]
        v64 = np.array(vq).astype(np.float64) * np.array(vs).astype(np.float64)[..., None]
        return kq, vq, ks, vs, tables, k64, v64
    k, v = (mx.array(x).astype(dtype) for x in raw)
    k64 = np.array(k.astype(mx.float32)).astype(np.float64)
    v64 = np.array(v.astype(mx.float32)).astype(np.float64)
    return k, v, None, None, tables, k64, v64


def _oracle(q: np.ndarray, k64, v64, table, context: int, length: int, scale: float):
    """q [L, H, D] at the last L of ``context`` positions -> [L, H, D], float64."""
    kv_heads = k64.shape[2]
    heads = q.shape[1]
    group = heads // kv_heads
    keys = k64[table].reshape(-1, kv_heads, k64.shape[3])[:context]
    values = v64[table].reshape(-1, kv_heads, v64.shape[3])[:context]
    out = np.zeros(q.shape, dtype=np.float64)
    for j in range(length):
        seen = context - length + j + 1
        for h in range(heads):
            s = keys[:seen, h // group] @ q[j, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[j, h] = (p / p.sum()) @ values[:seen, h // group]
    return out


def _step(rng: random.Random, decode_lengths: list[int], chunks: list[tuple[int, int]],
          heads: int, kv_heads: int, head_dim: int, block: int, dtype: mx.Dtype):
    """Decode rows of ``decode_lengths`` tokens and chunks (L new tokens ending a sequence of
    n tokens) laid out as the engine lays out a step; returns what the checks need."""
    lengths = decode_lengths + [n for _, n in chunks]
    k, v, ks, vs, tables, k64, v64 = _pool(rng, lengths, block, kv_heads, head_dim, dtype)
    works = []
    for n, table in zip(decode_lengths, tables):
        works.append(SequenceWork([1], n - 1, table, [(table[(n - 1) // block], (n - 1) % block)]))
    for (length, n), table in zip(chunks, tables[len(decode_lengths):]):
        start = n - length
        works.append(SequenceWork([1] * length, start, table,
                                  [(table[p // block], p % block) for p in range(start, n)]))
    batch = build_step_batch(works)
    q = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(
        (batch.tokens.shape[0], heads, 1, head_dim)).astype(np.float32)
    return batch, works, q, (k, v, ks, vs), (k64, v64)


def _check(batch, works, q, pools, pools64, scale=0.3, library=None, layout=None, tol=2e-4):
    k, v, ks, vs = pools
    layout = layout or cpu_kernel.HostLayout.of(batch)
    got = np.array(cpu_kernel.attend(mx.array(q), k, v, ks, vs, layout, scale, library))
    for w, row in zip(works, batch.work_rows):
        length = len(w.tokens)
        want = _oracle(q[row:row + length, :, 0], *pools64, list(w.blocks), w.start + length,
                       length, scale)
        np.testing.assert_allclose(got[row:row + length, :, 0], want, atol=tol, rtol=tol)
    return got


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16, mx.int8],
                         ids=["f32", "bf16", "f16", "int8"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("block", [8, 16, 32])
def test_a_step_of_decode_rows_and_chunks_equals_float64(dtype, heads, kv_heads, block):
    rng = random.Random(hash((str(dtype), heads, block)) & 0xFFFF)
    batch, works, q, pools, pools64 = _step(
        rng, [1, block - 1, block, block + 1, 3 * block + 5, 70], [(1, 9), (7, 7), (13, 200)],
        heads, kv_heads, 64, block, dtype)
    assert batch.padding and len(batch.prefills) == 2  # padding rows ride along
    _check(batch, works, q, pools, pools64)


@pytest.mark.parametrize("head_dim", [32, 80, 128])
def test_head_dims(head_dim):
    rng = random.Random(head_dim)
    batch, works, q, pools, pools64 = _step(rng, [5, 40, 33], [(12, 90)], 8, 2, head_dim, 16,
                                            mx.float32)
    _check(batch, works, q, pools, pools64)


@pytest.mark.parametrize(("environ", "sleeping"), [
    ({}, False), ({"OMP_WAIT_POLICY": "passive"}, True), ({"OMP_WAIT_POLICY": " PASSIVE "}, True),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, False), ({"GOMP_SPINCOUNT": "0"}, True),
    ({"GOMP_SPINCOUNT": "300000"}, False)])
def test_small_calls_split_only_where_blas_threads_sleep(environ, sleeping):
    assert cpu_kernel.blas_threads_sleep(environ) is sleeping


def test_a_call_split_over_threads_equals_its_one_thread_run():
    rng = random.Random(3)
    batch, works, q, pools, pools64 = _step(rng, [300, 17, 1200, 64], [(128, 2000)], 9, 3, 64,
                                            16, mx.float32)
    layout = cpu_kernel.HostLayout.of(batch)
    assert layout.cost.sum() >= cpu_kernel.THREAD_MIN_COST
    split = _check(batch, works, q, pools, pools64, layout=layout)
    if layout.threads > 1:
        one = cpu_kernel.HostLayout(layout.tables, layout.q_row, layout.q_len, layout.context,
                                    layout.cost, threads=1)
        alone = _check(batch, works, q, pools, pools64, layout=one)
        np.testing.assert_array_equal(split, alone)


def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone():
    """A library linked with -ffast-math sets flush-to-zero for the whole process when it
    loads (GCC's crtfastmath.o): every subnormal float anywhere would then read as 0."""
    assert cpu_kernel.ready()
    tiny = np.array([1e-39], dtype=np.float32) * np.float32(0.5)  # a subnormal result
    assert tiny[0] != 0.0
    assert np.nextafter(np.float32(0), np.float32(1)) > 0


def test_the_pool_is_read_in_place():
    """No copy of the pool per call: the kernel reads the array's own memory (a bfloat16
    pool through a uint16 view, which must share it: numpy has no bfloat16)."""
    k = mx.zeros((64, 16, 2, 32))
    mx.eval(k)
    view = cpu_kernel._host_view(k)
    assert view.ctypes.data == np.asarray(memoryview(k)).ctypes.data
    assert view.base is not None  # a view, not a copy
    k16 = mx.zeros((64, 16, 2, 32), dtype=mx.bfloat16)
    mx.eval(k16)
    as_half = k16.view(mx.float16)  # another view of the same bytes, read independently
    mx.eval(as_half)
    assert cpu_kernel._host_view(k16).ctypes.data == np.asarray(memoryview(as_half)).ctypes.data


# Plants on both ways of reading V: in place (a float32 pool's few rows: decode rows, a chunk
# of 3 positions x 3 heads) and widened into a tile (int8 and bfloat16 always; float32 for a
# chunk of many rows: 12 positions x 3 heads).
PLANTED = {
    "causal mask one token late": ("before + j + 1 - t0", "before + j + 2 - t0",
                                   mx.float32, [(9, 40)]),
    "no rescale of the sums so far": ("a[n] = ld8(ar + c + 8 * n) * sc;",
                                      "a[n] = ld8(ar + c + 8 * n);", mx.float32, [(4, 90)], 64),
    "no rescale in a head's last lanes": ("v8 a = ld8(ar + c) * splat8(rescale);",
                                          "v8 a = ld8(ar + c);", mx.float32, [(4, 90)]),
    "K transposed into the wrong lanes": ("st(kt + (i0 + 1) * BS + o0",
                                          "st(kt + (i0 + 2) * BS + o0", mx.float32, [(3, 50)]),
    "int8 K without its scales": ("k_scale[o] = static_cast<float>(a.k_scales[slot]);", "",
                                  mx.int8, [(3, 50)]),
    "V read with K's scales": ("v_scale[o] = static_cast<float>(a.v_scales[slot]);",
                               "v_scale[o] = static_cast<float>(a.k_scales[slot]);", mx.int8,
                               [(3, 50)]),
    "a widened V tile without int8's scales": ("ld4(v + o * stride + i) * splat(v_scale[o])",
                                               "ld4(v + o * stride + i)", mx.int8, [(12, 60)]),
    "V read in place at a tile's stride": ("v_stride = stride;",
                                           "v_stride = d_len;",
                                           mx.float32, [(3, 50)]),
    "V widened from the wrong token": ("ld4(v + o * stride + i)", "ld4(v + (o ^ 1) * stride + i)",
                                       mx.bfloat16, [(12, 60)]),
    "heads of a KV head mapped wrongly": (
        "(static_cast<size_t>(a.q_row[it] + j) * a.heads + kh * group + g) * d_len;\n"
        "      float* dst = qs",
        "(static_cast<size_t>(a.q_row[it] + j) * a.heads + g * a.kv_heads + kh) * d_len;\n"
        "      float* dst = qs", mx.float32, [(2, 30)]),
    "bfloat16 widened wrongly": ("wide << 16;", "wide << 15;", mx.bfloat16, [(2, 30)]),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_bugs_are_caught(bug, tmp_path, monkeypatch):
    """Each plant on a step whose shapes run the planted line: head dim 32 unless it says
    (P.V runs a head's lanes 64 at a time, then 8 at a time: 32 reaches only the latter)."""
    old, new, dtype, chunks, *given = PLANTED[bug]
    head_dim = given[0] if given else 32
    source = cpu_kernel.SOURCE_PATH.read_text()
    assert source.count(old) == 1, f"the plant site of {bug!r} moved"
    planted = tmp_path / "paged_attention_cpu.cpp"
    planted.write_text(source.replace(old, new))
    monkeypatch.setenv("PAGEDCHAT_KERNEL_CACHE", str(tmp_path / "cache"))
    library = cpu_kernel.build(Path(planted))
    rng = random.Random(5)
    batch, works, q, pools, pools64 = _step(rng, [20, 33], chunks, 6, 2, head_dim, 16, dtype)
    _check(batch, works, q, pools, pools64)  # the real kernel passes this very case
    with pytest.raises(AssertionError):
        _check(batch, works, q, pools, pools64, library=library)


# ---- the engine ---------------------------------------------------------------------------

EDIT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.mark.model
def test_the_engine_attends_with_the_kernel_and_gives_mlx_lm_greedy_replies():
    eng = Engine(EngineConfig(kv_memory_mib=24, block_size=16, max_batch=4, prefill_chunk=64,
                              speculative=False))
    eng.start()
    try:
        assert eng.wait_ready(600), eng.load_error
        assert eng.model_info.attention == "cpu-paged"
        prompts = [chat_prompt(EDIT), chat_prompt([{"role": "user", "content":
                                                    "Write a haiku about the sea."}])]
        handles = [eng.submit(prompt_tokens=p, params=SamplingParams(temperature=0.0,
                                                                     max_tokens=24),
                              session_id=f"k{i}") for i, p in enumerate(prompts)]
        for p, h in zip(prompts, handles):
            tokens, _ = collect(h)
            assert tokens[0] == greedy_reference(p, 24)
    finally:
        eng.stop()


@pytest.mark.model
def test_without_a_compiler_the_engine_keeps_the_mlx_formulation(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "_library", None)
    monkeypatch.setattr(cpu_kernel, "_failure", "no C++ compiler (test)")
    eng = Engine(EngineConfig(kv_memory_mib=24, block_size=16, max_batch=2))
    eng.start()
    try:
        assert eng.wait_ready(600), eng.load_error
        assert eng.model_info.attention == "reference"
        prompt = chat_prompt(EDIT)
        tokens, _ = collect(eng.submit(prompt_tokens=prompt,
                                       params=SamplingParams(temperature=0.0, max_tokens=12)))
        assert tokens[0] == greedy_reference(prompt, 12)
    finally:
        eng.stop()
