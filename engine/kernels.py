"""Metal paged-attention kernels: built once from ``shaders/paged_attention.metal``.

The decode path reads K/V straight from the block pool through the block tables (no gathered
copy). A call is described by a *launch plan* (:func:`plan_decode`): which kernel bodies run,
with which template arguments, grid, threadgroup and output shapes. :func:`run_plan` executes
a plan with ``mx.fast.metal_kernel`` on a Mac; the CPU emulation harness in
``tests/kernel_emulation`` executes the very same plan, so the geometry chosen here is what the
tests verify.

Kernel design (details in ``shaders/README.md``): one threadgroup per (sequence, KV head,
partition) serves every query head of that KV head (each K/V byte is read once); lanes split
head_dim so q.k is one ``simd_sum``; fp32 online softmax. When sequences x KV heads would leave
the GPU under-filled, long contexts are split into ~512-token partitions merged by a reduce
kernel (no reduce pass when there is a single partition).
"""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from engine.config import BLOCK_SIZES


def _shaders_root() -> Path:
    """The folder holding ``shaders/``: the project root from source; ``sys._MEIPASS`` in a
    PyInstaller bundle (packaging/pagedchat.spec ships ``shaders/`` there as data; the app's
    own files use the same rule through app/resources.py, which the engine must not import)."""
    base = getattr(sys, "_MEIPASS", None) if getattr(sys, "frozen", False) else None
    return Path(base) if base else Path(__file__).resolve().parent.parent


SHADER_PATH = _shaders_root() / "shaders" / "paged_attention.metal"

HEAD_DIMS = (64, 80, 96, 128)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
MAX_GROUP = 16  # query heads per KV head (register arrays are sized by it)

PARTITION_TOKENS = 512  # split-K partition size (a multiple of every block size)
SPLIT_BELOW_THREADGROUPS = 128  # fewer (sequence, KV head) pairs than this: GPU under-filled
MAX_SIMDGROUPS = 4  # simdgroups (of 32 threads) per threadgroup
TG_MEMORY_BUDGET = 16384  # bytes of threadgroup memory for the cross-simdgroup merge

_MARKER = "// ==== kernel: "


@dataclass(frozen=True)
class KernelSource:
    """One kernel body and the names ``mx.fast.metal_kernel`` builds its signature from."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ""


_SIGNATURES = {
    "paged_decode": (
        ("q", "k_pool", "v_pool", "block_tables", "context_lens", "scale"),
        ("out", "stats"),
    ),
    "paged_decode_reduce": (("part_out", "part_stats", "context_lens"), ("out",)),
}


def parse_shader(text: str) -> dict[str, KernelSource]:
    """Split the shader file at its ``// ==== kernel: NAME ====`` lines into kernel bodies."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith(_MARKER) and stripped.endswith("===="):
            name = stripped[len(_MARKER) :].rstrip("=").strip()
            if name in sections:
                raise ValueError(f"kernel {name!r} appears twice in the shader")
            current = sections[name] = []
        elif current is not None:
            current.append(line)
    missing = set(_SIGNATURES) - set(sections)
    if missing:
        raise ValueError(f"shader lacks kernels {sorted(missing)}")
    return {
        name: KernelSource(name, *_SIGNATURES[name], source="".join(sections[name]))
        for name in _SIGNATURES
    }


@lru_cache(maxsize=1)
def shader_sources() -> dict[str, KernelSource]:
    """The kernel bodies of ``shaders/paged_attention.metal`` (read once)."""
    return parse_shader(SHADER_PATH.read_text())


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype) -> bool:
    """Whether the decode kernel handles this attention shape (else use the reference path)."""
    return (
        head_dim in HEAD_DIMS
        and block_size in BLOCK_SIZES
        and dtype in DTYPES
        and num_kv_heads > 0
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
    )


@dataclass(frozen=True)
class DecodeGeometry:
    simdgroups: int  # per threadgroup
    partitions: int  # 1: single pass, no reduce
    partition_tokens: int  # 0 when partitions == 1


@lru_cache(maxsize=256)
def decode_geometry(
    batch: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    max_blocks: int,
    split: bool | None = None,
    simdgroups: int | None = None,
) -> DecodeGeometry:
    """Launch geometry for one shape family.

    ``split=None`` chooses split-K when the context can exceed one partition and
    ``batch * num_kv_heads`` threadgroups would leave the GPU under-filled; True/False force it
    (a context that fits one partition is never split). ``simdgroups`` overrides the choice.
    """
    partitions = max(1, math.ceil(max_blocks * block_size / PARTITION_TOKENS))
    if split is None:
        split = batch * num_kv_heads < SPLIT_BELOW_THREADGROUPS
    if not split:
        partitions = 1
    if simdgroups is None:
        simdgroups = MAX_SIMDGROUPS
        while simdgroups > 1 and simdgroups * group * head_dim * 4 > TG_MEMORY_BUDGET:
            simdgroups //= 2
        tokens = PARTITION_TOKENS if partitions > 1 else max_blocks * block_size
        blocks = max(1, math.ceil(tokens / block_size))
        while simdgroups > 1 and simdgroups > blocks:  # no idle simdgroups
            simdgroups //= 2
    return DecodeGeometry(simdgroups, partitions, PARTITION_TOKENS if partitions > 1 else 0)


class Ref(NamedTuple):
    """Output ``output`` of the earlier launch ``launch`` of the same plan."""

    launch: int
    output: int


@dataclass(frozen=True)
class Launch:
    kernel: KernelSource
    inputs: tuple  # mx.array | Ref, in kernel.input_names order
    template: tuple[tuple[str, object], ...]  # (name, mx.Dtype | int)
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple


@lru_cache(maxsize=64)
def _scale_array(scale: float) -> mx.array:
    return mx.array(scale, dtype=mx.float32)


def plan_decode(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    *,
    split: bool | None = None,
    simdgroups: int | None = None,
    sources: dict[str, KernelSource] | None = None,
) -> list[Launch]:
    """The launches computing ``reference_decode``'s result (output 0 of the last launch).

    Shapes as in ``engine.attention.reference_decode``: q [B, H, 1, D]; pools
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [B, max_blocks];
    context_lens [B] (each >= 1). The whole pool arrays are passed (a sliced view would be
    copied by ``ensure_row_contiguous``).
    """
    src = sources or shader_sources()
    if q.ndim != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be [B, H, 1, D], got {q.shape}")
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"pools must share a 4-d shape, got {k_pool.shape} and {v_pool.shape}")
    batch, num_heads, _, head_dim = q.shape
    _, block_size, num_kv_heads, pool_dim = k_pool.shape
    if pool_dim != head_dim:
        raise ValueError(f"head_dim {head_dim} != pool head_dim {pool_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} not in {HEAD_DIMS}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size {block_size} not in {BLOCK_SIZES}")
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads unsupported")
    if q.dtype not in DTYPES or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"dtypes {q.dtype}, {k_pool.dtype}, {v_pool.dtype} unsupported")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, max_blocks], got {block_tables.shape}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [{batch}], got {context_lens.shape}")
    if block_tables.dtype != mx.int32:
        block_tables = block_tables.astype(mx.int32)
    if context_lens.dtype != mx.int32:
        context_lens = context_lens.astype(mx.int32)

    group = num_heads // num_kv_heads
    if simdgroups is not None and (
        simdgroups not in (1, 2, 4, 8) or simdgroups * group * (head_dim + 2) * 4 > 32768
    ):
        raise ValueError(f"{simdgroups} simdgroups do not fit a threadgroup for this shape")
    geo = decode_geometry(
        batch, num_kv_heads, group, head_dim, block_size, block_tables.shape[1], split, simdgroups
    )
    parts = geo.partitions
    out_dtype = q.dtype if parts == 1 else mx.float32
    decode = Launch(
        kernel=src["paged_decode"],
        inputs=(q, k_pool, v_pool, block_tables, context_lens, _scale_array(float(scale))),
        template=(
            ("T", q.dtype),
            ("O", out_dtype),
            ("D", head_dim),
            ("BS", block_size),
            ("G", group),
            ("NSG", geo.simdgroups),
            ("PART", geo.partition_tokens),
        ),
        grid=(32 * geo.simdgroups * parts, num_kv_heads, batch),
        threadgroup=(32 * geo.simdgroups, 1, 1),
        output_shapes=((batch, num_heads, parts, head_dim), (batch, num_heads, parts, 2)),
        output_dtypes=(out_dtype, mx.float32),
    )
    if parts == 1:
        return [decode]
    reduce = Launch(
        kernel=src["paged_decode_reduce"],
        inputs=(Ref(0, 0), Ref(0, 1), context_lens),
        template=(("T", q.dtype), ("D", head_dim), ("PART", geo.partition_tokens)),
        grid=(32, num_heads, batch),
        threadgroup=(32, 1, 1),
        output_shapes=((batch, num_heads, 1, head_dim),),
        output_dtypes=(q.dtype,),
    )
    return [decode, reduce]


_kernel_lock = threading.Lock()
_kernel_objects: dict[KernelSource, object] = {}


def kernel_object(kernel: KernelSource):
    """The ``mx.fast.metal_kernel`` for ``kernel``, built once (MLX then compiles one pipeline
    per template instantiation, i.e. per shape family, and caches it)."""
    obj = _kernel_objects.get(kernel)
    if obj is None:
        with _kernel_lock:
            obj = _kernel_objects.get(kernel)
            if obj is None:
                obj = mx.fast.metal_kernel(
                    name=kernel.name,
                    input_names=list(kernel.input_names),
                    output_names=list(kernel.output_names),
                    source=kernel.source,
                    header=kernel.header,
                    ensure_row_contiguous=True,
                )
                _kernel_objects[kernel] = obj
    return obj


def run_plan(plan: list[Launch]) -> list[list[mx.array]]:
    """Execute a plan with the Metal backend; returns every launch's outputs."""
    results: list[list[mx.array]] = []
    for launch in plan:
        inputs = [results[x.launch][x.output] if isinstance(x, Ref) else x for x in launch.inputs]
        outputs = kernel_object(launch.kernel)(
            inputs=inputs,
            template=list(launch.template),
            grid=launch.grid,
            threadgroup=launch.threadgroup,
            output_shapes=[list(s) for s in launch.output_shapes],
            output_dtypes=list(launch.output_dtypes),
        )
        results.append(list(outputs))
    return results


def paged_decode_kernel(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
) -> mx.array:
    """``engine.attention.reference_decode`` on the Metal kernel: [B, H, 1, D]."""
    plan = plan_decode(q, k_pool, v_pool, block_tables, context_lens, scale)
    return run_plan(plan)[-1][0]
