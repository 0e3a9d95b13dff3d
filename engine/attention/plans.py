"""What the Metal and the CUDA paged-attention kernels share: sources, plans, checks, objects.

Both kernel modules (engine/attention/metal.py for Metal, engine/attention/cuda.py for CUDA)
describe a call as a *launch plan*: which kernel bodies run, with which template arguments, grid,
thread group and output shapes. The CPU emulation harness (tests/kernel_emulation) executes
the very same plans, so the geometry a backend module chooses is what CI verifies. Only the
geometry and the kernel language differ between the backends; everything else lives here,
once: where the shader files are, how a source file splits into kernel bodies, the plan's
types, the attention shapes both kernels handle and the checks on a call's arrays, building
each kernel object once, and running a plan. Each shape's plan is kept in a bounded cache
(engine/attention/plan_cache.py) so that a step's layers only pass arrays.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from engine.config import BLOCK_SIZES
from engine.kv import int8

HEAD_DIMS = (64, 80, 96, 128)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
MAX_GROUP = 16  # query heads per KV head (register arrays are sized by it)
PARTITION_TOKENS = 512  # split-K partition size (a multiple of every block size)

#: The suffix of an attention kernel's 8-bit variant (issue #26): the same body with
#: ``#define PC_KV8 1`` in front, int8 pools and two scale inputs after ``v_pool``.
Q8 = "_q8"
Q8_DEFINE = "#define PC_KV8 1\n"
Q8_INPUTS = ("q", "k_pool", "v_pool", "k_scales", "v_scales", "block_tables", "context_lens",
             "scale")

_KERNEL_MARKER = "// ==== kernel: "
_HEADER_MARKER = "// ==== header ===="


def shaders_root() -> Path:
    """The folder holding ``shaders/``: the project root from source; ``sys._MEIPASS`` in a
    PyInstaller bundle (packaging/pagedchat.spec ships ``shaders/`` there as data; the app's
    own files use the same rule through app/ui/resources.py, which the engine must not import)."""
    base = getattr(sys, "_MEIPASS", None) if getattr(sys, "frozen", False) else None
    return Path(base) if base else Path(__file__).resolve().parents[2]  # engine/attention/plans.py


@dataclass(frozen=True)
class KernelSource:
    """One kernel body and the names ``mx.fast.*_kernel`` builds its signature from."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ""


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
    #: Inputs the kernel writes through its pointer (engine/attention/kv_write.py's
    #: in-place stores), by index: nothing on a GPU, where MLX passes every input's own
    #: buffer; the CPU emulator maps them writable and hands them back.
    in_place: tuple[int, ...] = ()


Signatures = Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]


def attention_signatures(attend: str, reduce: str) -> Signatures:
    """Both backends' two kernels take the same arguments: the attention kernel reads the
    pool and writes outputs (with per-partition softmax stats); the reduce kernel merges
    the partitions of a split-K launch."""
    return {
        attend: (("q", "k_pool", "v_pool", "block_tables", "context_lens", "scale"),
                 ("out", "stats")),
        reduce: (("part_out", "part_stats", "context_lens"), ("out",)),
    }


def parse_kernel_source(text: str, signatures: Signatures, what: str) -> dict[str, KernelSource]:
    """Split a shader file at its ``// ==== kernel: NAME ====`` lines into kernel bodies,
    each given the shared text under an optional ``// ==== header ====`` line as its header.
    ``signatures`` names each kernel's inputs and outputs; ``what`` names the file in errors."""
    header: list[str] = []
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped == _HEADER_MARKER:
            current = header
        elif stripped.startswith(_KERNEL_MARKER) and stripped.endswith("===="):
            name = stripped[len(_KERNEL_MARKER) :].rstrip("=").strip()
            if name in sections:
                raise ValueError(f"kernel {name!r} appears twice in the {what}")
            current = sections[name] = []
        elif current is not None:
            current.append(line)
    missing = set(signatures) - set(sections)
    if missing:
        raise ValueError(f"{what} lacks kernels {sorted(missing)}")
    head = "".join(header)
    return {
        name: KernelSource(name, *signatures[name], source="".join(sections[name]), header=head)
        for name in signatures
    }


def with_q8_variant(sources: dict[str, KernelSource], attend: str) -> dict[str, KernelSource]:
    """``sources`` plus ``attend + Q8``: the attention kernel's body compiled for an 8-bit
    pool (``PC_KV8``), so the two variants share every line but the dequantization (and a
    planted bug in the file reaches both)."""
    base = sources[attend]
    q8 = KernelSource(attend + Q8, Q8_INPUTS, base.output_names, Q8_DEFINE + base.source,
                      base.header)
    return {**sources, q8.name: q8}


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype) -> bool:
    """Whether the kernels handle this attention shape (else use the reference path)."""
    return (
        head_dim in HEAD_DIMS
        and block_size in BLOCK_SIZES
        and dtype in DTYPES
        and num_kv_heads > 0
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
    )


@dataclass(frozen=True)
class CallShape:
    """The dimensions of one attention call, read off its arrays."""

    batch: int
    num_heads: int
    query_len: int
    head_dim: int
    block_size: int
    num_kv_heads: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def checked_call(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array,
    context_lens: mx.array, k_scales: mx.array | None = None, v_scales: mx.array | None = None,
) -> tuple[CallShape, mx.array, mx.array]:
    """The call's shape and its block tables and lengths as int32, or a ValueError naming
    what a kernel cannot take: q [B, H, L, D]; pools [num_blocks, block_size, kv_heads, D];
    block_tables [B, max_blocks]; context_lens [B]; an 8-bit pool's scales
    [num_blocks, block_size, kv_heads] fp16 (both or neither)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, H, L, D], got {q.shape}")
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"pools must share a 4-d shape, got {k_pool.shape} and {v_pool.shape}")
    if 0 in q.shape or 0 in block_tables.shape or 0 in k_pool.shape:
        # MLX's CUDA graphs reject a zero-sized launch (cudaGraphAddKernelNode: invalid
        # argument) at evaluation, far from the caller: refuse it here, by name.
        raise ValueError(f"a kernel launch over an empty dimension: q {q.shape}, "
                         f"block_tables {block_tables.shape}, pool {k_pool.shape}")
    batch, num_heads, query_len, head_dim = q.shape
    _, block_size, num_kv_heads, pool_dim = k_pool.shape
    if pool_dim != head_dim:
        raise ValueError(f"head_dim {head_dim} != pool head_dim {pool_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} not in {HEAD_DIMS}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size {block_size} not in {BLOCK_SIZES}")
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads unsupported")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("an 8-bit pool needs both k_scales and v_scales")
    pool_dtype = q.dtype if k_scales is None else int8.INT8
    if q.dtype not in DTYPES or k_pool.dtype != pool_dtype or v_pool.dtype != pool_dtype:
        raise ValueError(f"dtypes {q.dtype}, {k_pool.dtype}, {v_pool.dtype} unsupported"
                         + ("" if k_scales is None else " (an 8-bit pool is int8)"))
    if k_scales is not None:
        for sc in (k_scales, v_scales):
            if sc.shape != k_pool.shape[:3] or sc.dtype != int8.SCALE_DTYPE:
                raise ValueError(f"scales must be {k_pool.shape[:3]} {int8.SCALE_DTYPE}, "
                                 f"got {sc.shape} {sc.dtype}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, max_blocks], got {block_tables.shape}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [{batch}], got {context_lens.shape}")
    shape = CallShape(batch, num_heads, query_len, head_dim, block_size, num_kv_heads)
    return shape, as_int32(block_tables), as_int32(context_lens)


def as_int32(a: mx.array) -> mx.array:
    return a if a.dtype == mx.int32 else a.astype(mx.int32)


def partitions_for(batch: int, num_kv_heads: int, block_size: int, max_blocks: int,
                   split: bool | None, split_below: int) -> int:
    """How many ``PARTITION_TOKENS`` partitions a context is split into (split-K).

    ``split=None`` splits when the context can exceed one partition and fewer than
    ``split_below`` (sequence, KV head) groups would leave the GPU under-filled; True/False
    force it (a context that fits one partition is never split)."""
    if split is None:
        split = batch * num_kv_heads < split_below
    if not split:
        return 1
    return max(1, math.ceil(max_blocks * block_size / PARTITION_TOKENS))


def workers_for(partitions: int, most: int, rows: int, head_dim: int, budget: int,
                block_size: int, max_blocks: int) -> int:
    """Simdgroups (Metal) or warps (CUDA) per group: at most ``most``, halved until the
    cross-worker merge of ``rows`` fp32 rows of ``head_dim`` fits ``budget`` bytes of
    shared memory and no worker is left without a block of its partition to read."""
    workers = most
    while workers > 1 and workers * rows * head_dim * 4 > budget:
        workers //= 2
    tokens = PARTITION_TOKENS if partitions > 1 else max_blocks * block_size
    blocks = max(1, math.ceil(tokens / block_size))
    while workers > 1 and workers > blocks:  # no idle workers
        workers //= 2
    return workers


def reduce_launch(kernel: KernelSource, shape: CallShape, context_lens: mx.array, dtype,
                  partition_tokens: int) -> Launch:
    """The split-K reduce: merges output 0 and 1 (outputs, softmax stats) of the plan's first
    launch into one [B, H, 1, D] output of ``dtype``; one 32-thread group per (sequence,
    head)."""
    return Launch(
        kernel=kernel,
        inputs=(Ref(0, 0), Ref(0, 1), context_lens),
        template=(("T", dtype), ("D", shape.head_dim), ("PART", partition_tokens)),
        grid=(32, shape.num_heads, shape.batch),
        threadgroup=(32, 1, 1),
        output_shapes=((shape.batch, shape.num_heads, 1, shape.head_dim),),
        output_dtypes=(dtype,),
    )


class KernelSet:
    """One backend's kernels: its shader file, parsed once, and the ``mx.fast`` kernel object
    of each kernel, built once per process (MLX then compiles one pipeline or module per
    template instantiation, i.e. per shape family, and caches it). ``factory`` names the
    ``mx.fast`` builder, ``metal_kernel`` or ``cuda_kernel``; it is looked up when first
    needed, so planning (and the CPU emulation of a plan) needs neither backend."""

    def __init__(self, factory: str, path: Path, attend: str | None, reduce: str | None,
                 what: str, signatures: Signatures | None = None) -> None:
        """``attend`` / ``reduce``: the attention kernels (``attention_signatures``; the
        attention kernel gets its 8-bit variant); or ``signatures`` for a file of other
        kernels (engine/attention/kv_write.py), with ``attend`` and ``reduce`` None."""
        self.attend = attend
        self.factory = factory
        self.path = path
        self.signatures = signatures or attention_signatures(attend, reduce)
        self.what = what
        self._sources: dict[str, KernelSource] | None = None
        self._lock = threading.Lock()
        self._objects: dict[KernelSource, object] = {}

    def parse(self, text: str) -> dict[str, KernelSource]:
        """The kernels of ``text``, a version of the shader file (tests plant mutants), with
        the attention kernel's 8-bit variant (``with_q8_variant``)."""
        sources = parse_kernel_source(text, self.signatures, self.what)
        return sources if self.attend is None else with_q8_variant(sources, self.attend)

    def sources(self) -> dict[str, KernelSource]:
        """The kernels of the shader file (read once)."""
        if self._sources is None:
            self._sources = self.parse(self.path.read_text())
        return self._sources

    def get(self, kernel: KernelSource):
        obj = self._objects.get(kernel)
        if obj is None:
            with self._lock:
                obj = self._objects.get(kernel)
                if obj is None:
                    obj = getattr(mx.fast, self.factory)(
                        name=kernel.name,
                        input_names=list(kernel.input_names),
                        output_names=list(kernel.output_names),
                        source=kernel.source,
                        header=kernel.header,
                        ensure_row_contiguous=True,
                    )
                    self._objects[kernel] = obj
        return obj

    def run(self, plan: list[Launch], **options) -> list[list[mx.array]]:
        """Execute a plan on this backend; returns every launch's outputs. ``options`` go to
        each kernel call (``verbose=True`` prints the generated source)."""
        results: list[list[mx.array]] = []
        for launch in plan:
            inputs = [results[x.launch][x.output] if isinstance(x, Ref) else x
                      for x in launch.inputs]
            outputs = self.get(launch.kernel)(
                inputs=inputs,
                template=list(launch.template),
                grid=launch.grid,
                threadgroup=launch.threadgroup,
                output_shapes=[list(s) for s in launch.output_shapes],
                output_dtypes=list(launch.output_dtypes),
                **options,
            )
            results.append(list(outputs))
        return results
