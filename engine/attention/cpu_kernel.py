"""Paged attention on MLX's CPU backend as a compiled kernel (``shaders/paged_attention_cpu.cpp``).

Why: on the CPU the reference path (engine/attention/cpu_sdpa.py) gathers each row's context
into a contiguous copy, writes a score matrix and passes over it several times; a prompt
chunk at a long context then costs several decode steps (issue #24's paste: 8 tokens at
3,600 tokens of context about 2 decode steps of the default model), and a drafting row
costs about a decode row (issue #28). MLX has no custom-kernel API on its CPU backend, so
the kernel is C++ built with the system's compiler at first use (cached by the source's
and the flags' hash) and called through ctypes on the pool's own memory: one call per layer
for the whole step, every decode row and chunk an *item* read through its block table, the
work split over the cores by cost. Measured on our 2-core machine (default model's shapes,
one layer, medians): 14 prompt tokens over 3,200 tokens of context 4.2 ms against 11.7 ms
for the MLX formulation, 64 over 3,200 16.4 ms against 33.8, 8 over 2,400 3.2 against 7.4,
a decode row over 300 tokens 0.24 ms against 0.63 (bench/results/paste.md). A first version
that left its accumulators to the compiler (arrays under ``omp simd``) was slower than the
MLX formulation, whose products are BLAS matmuls: the kernel's worth is its register
blocking.

The price: the step's graph is evaluated layer by layer (the kernel reads the pool once the
layer's writes are in it), which on the CPU costs little (its steps run synchronously and
each op runs on the CPU anyway). Where no compiler is found or the build fails, the engine
keeps the MLX formulation (``ready()`` is False; the reason is logged once).

Never used on a GPU backend (the Metal and CUDA kernels serve there), nor under
``EngineConfig(attention="reference")``, which keeps the oracle path on the CPU too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.attention.plans import shaders_root

logger = logging.getLogger(__name__)

SOURCE_PATH = shaders_root() / "shaders" / "paged_attention_cpu.cpp"
#: The step's K/V writes (``paged_write_cpu``), linked into the same library: compiled
#: without -ffast-math, so an int8 pool is quantized exactly as engine/kv/int8.py does.
WRITE_SOURCE_PATH = shaders_root() / "shaders" / "kv_write_cpu.cpp"
#: -ffast-math lets the exp and the sums vectorize (the kernel keeps no infinities: its
#: running maxima start at a finite floor); -march=native is why the cache key holds the
#: machine's CPU flags. Compiled only: the library is linked by ``LINK_FLAGS``, without
#: -ffast-math, because GCC then links ``crtfastmath.o``, whose constructor sets the CPU's
#: flush-to-zero mode when the library loads, for the whole process: subnormal floats then
#: read as 0 everywhere (hypothesis caught it in tests/test_telemetry.py).
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC",
         "-pthread")
LINK_FLAGS = ("-shared", "-pthread")
WRITE_FLAGS = tuple(f for f in FLAGS if f != "-ffast-math")
#: Below this much work (query positions x context tokens, summed over the items) a call
#: runs on one thread. What decides it is not the cost of starting a thread (microseconds)
#: but whether OpenBLAS's OpenMP threads sleep after the layer's matmuls or spin, taking the
#: cores a second kernel thread needs. Spinning (libgomp's default): inside a whole step, 14
#: prompt tokens at 3,200 tokens of context took 383 ms on one thread against 571 ms on two
#: (our 2-core machine), while 64 tokens there gained from two (1,049 ms against 1,147), so
#: only big calls split. Sleeping (``OMP_WAIT_POLICY=PASSIVE``, which ``scripts/env.sh`` and
#: the app's OpenBLAS loader set): two threads were no slower at any size measured (four
#: decode rows alone, or beside 4 prompt tokens at 1,000) and faster from 8 prompt tokens at
#: 1,000 on (a step of 4 decodes + 14 at 3,200: 386 ms against 458, docs/FACTS.md).
THREAD_MIN_COST_SPINNING = 150_000
THREAD_MIN_COST_SLEEPING = 4_000


def blas_threads_sleep(environ=os.environ) -> bool:
    """Whether libgomp's threads (OpenBLAS's, here) wait passively: libgomp reads these
    variables when it loads, before MLX is imported, so the environment tells."""
    return (environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
            or environ.get("GOMP_SPINCOUNT", "").strip() == "0")


THREAD_MIN_COST = THREAD_MIN_COST_SLEEPING if blas_threads_sleep() else THREAD_MIN_COST_SPINNING
_DTYPES = {mx.float32: 0, mx.bfloat16: 1, mx.float16: 2, mx.int8: 3}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("PAGEDCHAT_KERNEL_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "pagedchat" / "cpu_kernels"


def compiler() -> str | None:
    """The C++ compiler the kernel is built with: ``$CXX``, else g++, c++ or clang++ on PATH
    (None: the engine attends with the MLX formulation; app/self_test.py asks too)."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(source_path: Path = SOURCE_PATH,
          write_source_path: Path = WRITE_SOURCE_PATH) -> ctypes.CDLL:
    """Compile the attention source and the write source (cached by their hashes, the flags,
    the compiler and the CPU) into one library and load it. Tests build altered sources
    through it."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    sources = [source_path.read_bytes(), write_source_path.read_bytes()]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    flags = " | ".join(" ".join(f) for f in (FLAGS, WRITE_FLAGS, LINK_FLAGS))
    key = hashlib.sha256(b"\0".join([*sources, flags.encode(), version.encode(),
                                     _cpu_flags().encode(), platform.machine().encode()]))
    target = _cache_dir() / f"paged_attention_cpu-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # built beside the target, then renamed: two processes never load a half-written file
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            obj, write_obj = Path(tmp) / "kernel.o", Path(tmp) / "write.o"
            for command in ([cxx, *FLAGS, "-c", str(source_path), "-o", str(obj)],
                            [cxx, *WRITE_FLAGS, "-c", str(write_source_path), "-o",
                             str(write_obj)],
                            [cxx, *LINK_FLAGS, str(obj), str(write_obj), "-o", str(built)]):
                done = subprocess.run(command, capture_output=True, text=True, timeout=300)
                if done.returncode != 0:
                    raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
            os.replace(built, target)
    library = ctypes.CDLL(str(target))
    fn = library.paged_attention_cpu
    fn.restype = ctypes.c_int
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    fn.argtypes = [i, p, p, p, p, p, p, i, p, p, p, p, i, i, i, i, i, f, i, p]
    write = library.paged_write_cpu
    write.restype = ctypes.c_int
    write.argtypes = [i, p, p, i, p, p, i, i, i, i, p, p, p, p]
    return library


def ready() -> bool:
    """True once the kernel is built and loaded (built on the first call; False for good,
    with the reason logged once, where it cannot be)."""
    global _library, _failure
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = build()
            except Exception as e:  # no compiler, a failed build, an unloadable library
                _failure = str(e)
                logger.warning("CPU attention kernel unavailable, using the MLX formulation: %s",
                               e)
        return _library is not None


def supports(dtype: mx.Dtype, block_size: int, head_dim: int) -> bool:
    """Whether the kernel reads a pool of ``dtype`` in blocks of ``block_size`` with heads of
    ``head_dim`` (a multiple of 4: its lanes)."""
    return dtype in _DTYPES and block_size in (8, 16, 32) and head_dim % 4 == 0


@dataclass(frozen=True)
class HostLayout:
    """A step's attention items on the host, built once per step for every layer: item i's
    queries are rows ``q_row[i] .. q_row[i] + q_len[i]``, the last of them attending to
    ``context[i]`` tokens through ``tables[i]``."""

    tables: np.ndarray  # int32 [items, width]
    q_row: np.ndarray  # int32 [items]
    q_len: np.ndarray
    context: np.ndarray
    cost: np.ndarray  # int64 [items]: query rows x context (the threads' split)
    threads: int
    #: int32 [T]: the slot (block, offset) each of the step's T rows writes its K/V to
    #: (``attend``'s ``new_kv``); None: a layout for reading only.
    write_blocks: np.ndarray | None = None
    write_offsets: np.ndarray | None = None

    @classmethod
    def of(cls, batch) -> HostLayout:
        """The items of a ``StepBatch`` (engine/runner/step_batch.py): each decode row (the
        padding rows included: one token of block 0), then each prompt chunk."""
        parts_tables, rows, lens, ctxs = [], [], [], []
        if batch.num_decode:
            tables = np.asarray(batch.decode_tables, dtype=np.int32)
            parts_tables.append(tables)
            rows.append(np.arange(batch.num_decode, dtype=np.int32))
            lens.append(np.ones(batch.num_decode, dtype=np.int32))
            ctxs.append(np.asarray(batch.decode_lens, dtype=np.int32))
        for chunk in batch.prefills:
            parts_tables.append(np.asarray(chunk.block_table, dtype=np.int32)[None])
            rows.append(np.array([chunk.row_start], dtype=np.int32))
            lens.append(np.array([chunk.length], dtype=np.int32))
            ctxs.append(np.array([chunk.context_len], dtype=np.int32))
        width = max(t.shape[1] for t in parts_tables)
        tables = np.zeros((sum(t.shape[0] for t in parts_tables), width), dtype=np.int32)
        at = 0
        for t in parts_tables:
            tables[at:at + t.shape[0], :t.shape[1]] = t
            at += t.shape[0]
        q_len, context = np.concatenate(lens), np.concatenate(ctxs)
        cost = q_len.astype(np.int64) * context
        threads = min(os.cpu_count() or 1, 8) if int(cost.sum()) >= THREAD_MIN_COST else 1
        return cls(tables, np.concatenate(rows), q_len, context, cost, threads,
                   np.asarray(batch.write_blocks, dtype=np.int32),
                   np.asarray(batch.write_offsets, dtype=np.int32))


def _host_view(a: mx.array) -> np.ndarray:
    """The evaluated array's own memory as numpy (no copy; bfloat16 through a uint16 view)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
        mx.eval(a)
    view = np.asarray(memoryview(a))
    if not view.flags.c_contiguous:
        raise ValueError("the kernel reads row-major arrays only")
    return view


def attend(queries: mx.array, k_pool: mx.array, v_pool: mx.array, k_scales: mx.array | None,
           v_scales: mx.array | None, layout: HostLayout, scale: float,
           library: ctypes.CDLL | None = None,
           new_kv: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """Every row of a step: queries [T, heads, 1, head_dim] -> the same shape and dtype. The
    pools as engine/attention/dispatch.py describes them (an int8 pool with its scales);
    ``library``: another build of the kernel (tests), else the one ``ready()`` loaded.

    ``new_kv``: the layer's K and V of the step's rows ([T, kv_heads, head_dim]), written into
    the pool in place at the layout's slots before any row attends (quantized in an int8
    pool, exactly as engine/kv/int8.py does): the layer's write as one call, not as MLX
    scatters (shaders/kv_write_cpu.cpp says what that saves)."""
    rows, heads, _, head_dim = queries.shape
    q = queries.reshape(rows, heads, head_dim).astype(mx.float32)
    arrays = [q, k_pool, v_pool] + ([k_scales, v_scales] if k_scales is not None else [])
    if new_kv is not None:
        new_kv = _row_dtype(new_kv, k_pool, k_scales)
        arrays += list(new_kv)
    mx.eval(*arrays)
    library = library or _library
    q_host = _host_view(q)
    k_host, v_host = _host_view(k_pool), _host_view(v_pool)
    ks = vs = None
    if k_scales is not None:
        ks, vs = _host_view(k_scales), _host_view(v_scales)
    if new_kv is not None:
        _write_host(library, k_host, v_host, ks, vs, *new_kv, layout.write_blocks,
                    layout.write_offsets)
    _, block_size, kv_heads, _ = k_pool.shape
    out = np.empty((rows, heads, head_dim), dtype=np.float32)
    status = library.paged_attention_cpu(
        _DTYPES[k_pool.dtype], q_host.ctypes.data, k_host.ctypes.data, v_host.ctypes.data,
        None if ks is None else ks.ctypes.data, None if vs is None else vs.ctypes.data,
        layout.tables.ctypes.data, layout.tables.shape[1], layout.q_row.ctypes.data,
        layout.q_len.ctypes.data, layout.context.ctypes.data, layout.cost.ctypes.data,
        len(layout.q_len), heads, kv_heads, head_dim, block_size, scale, layout.threads,
        out.ctypes.data)
    if status != 0:
        raise RuntimeError(f"the CPU attention kernel failed ({status})")
    del q_host, k_host, v_host, ks, vs  # no view of the pool outlives the call
    return mx.array(out).astype(queries.dtype).reshape(rows, heads, 1, head_dim)


def write(k_pool: mx.array, v_pool: mx.array, k_scales: mx.array | None,
          v_scales: mx.array | None, keys: mx.array, values: mx.array, blocks: np.ndarray,
          offsets: np.ndarray, library: ctypes.CDLL | None = None) -> None:
    """Row t of ``keys``/``values`` ([T, kv_heads, head_dim]) into slot (blocks[t],
    offsets[t]) of the pool, in place: what ``KVPool.write`` does with MLX ops, bit for bit
    (an int8 pool quantized as engine/kv/int8.py does). ``attend``'s ``new_kv`` does the
    same on the pool views it already holds."""
    keys, values = _row_dtype((keys, values), k_pool, k_scales)
    scales = [k_scales, v_scales] if k_scales is not None else []
    mx.eval(k_pool, v_pool, keys, values, *scales)
    ks, vs = (_host_view(a) for a in scales) if scales else (None, None)
    _write_host(library or _library, _host_view(k_pool), _host_view(v_pool), ks, vs, keys,
                values, np.asarray(blocks, dtype=np.int32), np.asarray(offsets, dtype=np.int32))


def _row_dtype(rows: tuple[mx.array, mx.array], k_pool: mx.array,
               k_scales: mx.array | None) -> tuple[mx.array, mx.array]:
    """An int8 pool quantizes float32 rows; any other pool takes rows of its own dtype;
    row-major either way (a model may hand over a strided view)."""
    dtype = mx.float32 if k_scales is not None else k_pool.dtype
    return mx.contiguous(rows[0].astype(dtype)), mx.contiguous(rows[1].astype(dtype))


def _write_host(library: ctypes.CDLL, k_host: np.ndarray, v_host: np.ndarray,
                ks: np.ndarray | None, vs: np.ndarray | None, keys: mx.array, values: mx.array,
                blocks: np.ndarray, offsets: np.ndarray) -> None:
    """The write on the pool's host views (``_host_view``; ``ks``/``vs``: an int8 pool's
    scales, else None) from evaluated rows of the pool's row dtype (``_row_dtype``)."""
    rows, kv_heads, head_dim = keys.shape
    if values.shape != keys.shape or k_host.shape[2:] != (kv_heads, head_dim):
        raise ValueError(f"K/V rows {keys.shape} / {values.shape} do not fit a pool of "
                         f"{k_host.shape}")
    if blocks.shape != (rows,) or offsets.shape != (rows,):
        raise ValueError(f"{rows} rows need {rows} slots, got {blocks.shape} / {offsets.shape}")
    k_rows, v_rows = _host_view(keys), _host_view(values)
    quantized = ks is not None
    status = library.paged_write_cpu(
        0 if quantized else k_host.itemsize, k_rows.ctypes.data, v_rows.ctypes.data, rows,
        blocks.ctypes.data, offsets.ctypes.data, k_host.shape[0], k_host.shape[1], kv_heads,
        head_dim, k_host.ctypes.data, v_host.ctypes.data,
        ks.ctypes.data if quantized else None, vs.ctypes.data if quantized else None)
    if status != 0:
        raise ValueError(f"a K/V slot is outside the pool of {k_host.shape[0]} blocks of "
                         f"{k_host.shape[1]} (blocks {blocks.tolist()}, offsets "
                         f"{offsets.tolist()}); nothing was written")
