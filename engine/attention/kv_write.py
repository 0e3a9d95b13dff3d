"""The pool's K/V writes on CUDA: one launch a layer, into the pool (``shaders/kv_write.cu``).

Why: a step writes every layer's new K/V rows into the pool. Written by MLX's scatters, a bf16
pool's write is two launches a layer and an 8-bit pool's a quantizer and four scatters (K, V
and their scales); on a GPU each is a kernel launch in every layer of every step. Measured on
an H100 (scripts/gpu/kv_write_cost.py, 8B shape, 64 rows, 32 layers): a step's writes cost
0.55 ms for bf16 and 1.55 ms for int8 with the quantizer in one kernel (5.2 ms op by op).

``store_kv`` writes a layer's rows into their slots in one launch (``kv_store``; the 8-bit
``kv_store_q8`` quantizes them on the way, with ``engine.kv.int8.quantize``'s arithmetic). MLX's
kernels cannot declare an output that aliases an input, so the kernel writes through its pool
inputs' pointers, as the CPU kernel writes the pool through ctypes
(engine/attention/cpu_kernel.py). Two things make that sound, and the caller owes both:

* **the pool's own buffer**: MLX hands a kernel a row-contiguous input as is and a strided one
  as a copy (which the write would then land in). Every pool array is allocated whole and
  replaced only by whole-array scatters (engine/kv/pool.py), so it is row-contiguous; the
  GPU check compares the kernel path's replies with the reference path's, which a lost write
  would change.
* **order**: MLX's CUDA backend records a step as a CUDA graph whose launches are ordered by
  the buffers they exchange; a write MLX does not know of orders nothing. So the kernel passes
  the layer's softmax scale on (``attend_scale``, output 0) and the layer's attention kernels
  read it in place of their own: they run after the write. Nothing else reads a layer's pool
  inside a step, and steps run in stream order. A step that wants no logits evaluates these
  scales (``engine.runner.model_adapter.PagedModel.written``).

Where the attention kernels do not serve a layer (the reference path reads the pool with MLX
gathers, which that edge does not order) the pool is written by scatters:
``quantize_kv`` makes an 8-bit pool's rows with one ``kv_quantize`` launch on CUDA, or with
``int8.quantize_kv`` (the MLX formulation, compiled) elsewhere. As with the attention kernels,
a call is a *launch plan*, which the CPU emulation harness (tests/kernel_emulation/
cuda_generator.py) executes too.
"""

from __future__ import annotations

import mlx.core as mx

from engine.attention.plan_cache import PlanCache
from engine.attention.plans import HEAD_DIMS, KernelSet, Launch, shaders_root
from engine.kv import int8

WRITE_SHADER_PATH = shaders_root() / "shaders" / "kv_write.cu"
THREADS_PER_BLOCK = 256  # 8 warps, one (row, KV head) of K or V each
KERNEL = "kv_quantize"
STORE = "kv_store"
STORE_Q8 = "kv_store_q8"
ROW_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

KERNELS = KernelSet("cuda_kernel", WRITE_SHADER_PATH, None, None, "CUDA K/V write source",
                    signatures={
                        KERNEL: (("keys", "values"), ("k_q", "k_scales", "v_q", "v_scales")),
                        STORE: (("keys", "values", "slot_blocks", "slot_offsets", "k_pool",
                                 "v_pool", "scale"), ("attend_scale",)),
                        STORE_Q8: (("keys", "values", "slot_blocks", "slot_offsets", "k_pool",
                                    "v_pool", "k_scales", "v_scales", "scale"),
                                   ("attend_scale",)),
                    })


def _checked_rows(keys: mx.array, values: mx.array) -> tuple[int, int, int]:
    if keys.ndim != 3 or keys.shape != values.shape:
        raise ValueError(f"K/V rows must share a [rows, kv_heads, head_dim] shape, got "
                         f"{keys.shape} and {values.shape}")
    if keys.dtype != values.dtype or keys.dtype not in ROW_DTYPES:
        raise ValueError(f"K/V rows of {keys.dtype} / {values.dtype}: the kernel takes one of "
                         f"{ROW_DTYPES}")
    rows, kv_heads, head_dim = keys.shape
    if head_dim not in HEAD_DIMS or rows * kv_heads == 0:
        raise ValueError(f"K/V rows {keys.shape}: head_dim in {HEAD_DIMS}, no empty dimension")
    return rows, kv_heads, head_dim


def plan_quantize(keys: mx.array, values: mx.array, sources=None) -> list[Launch]:
    """The launch quantizing ``keys`` and ``values`` ([rows, kv_heads, head_dim], one float
    dtype) into (k_q, k_scales, v_q, v_scales) as ``int8.quantize`` does; ``sources``: another
    version of the shader file's kernels (tests)."""
    rows, kv_heads, head_dim = _checked_rows(keys, values)
    src = sources or KERNELS.sources()
    return [Launch(
        kernel=src[KERNEL],
        inputs=(keys, values),
        template=(("T", keys.dtype), ("D", head_dim)),
        grid=(32 * 2 * rows * kv_heads, 1, 1),
        threadgroup=(THREADS_PER_BLOCK, 1, 1),
        output_shapes=(keys.shape, (rows, kv_heads), keys.shape, (rows, kv_heads)),
        output_dtypes=(int8.INT8, int8.SCALE_DTYPE, int8.INT8, int8.SCALE_DTYPE),
    )]


def plan_store(keys: mx.array, values: mx.array, slot_blocks: mx.array, slot_offsets: mx.array,
               k_pool: mx.array, v_pool: mx.array, scale: mx.array,
               k_scales: mx.array | None = None, v_scales: mx.array | None = None,
               sources=None) -> list[Launch]:
    """The launch writing ``keys`` / ``values`` ([rows, kv_heads, head_dim]) into slots
    (``slot_blocks[i]``, ``slot_offsets[i]``) of the pools, in place; an 8-bit pool (with
    ``k_scales`` / ``v_scales``) stores them as ``int8.quantize`` does. A block id of -1 is
    the pool's last (scratch) block. Output 0 is ``scale`` (float32 [1]), passed on."""
    rows, kv_heads, head_dim = _checked_rows(keys, values)
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape or k_pool.shape[2:] != keys.shape[1:]:
        raise ValueError(f"pools {k_pool.shape} / {v_pool.shape} do not hold rows of "
                         f"{keys.shape[1:]}")
    if (k_scales is None) != (v_scales is None) or (
            k_scales is None and k_pool.dtype == int8.INT8):
        raise ValueError("an 8-bit pool needs both k_scales and v_scales")
    quantized = k_scales is not None
    pool_dtype = int8.INT8 if quantized else keys.dtype
    if k_pool.dtype != pool_dtype or v_pool.dtype != pool_dtype:
        raise ValueError(f"rows of {keys.dtype} go into a pool of {pool_dtype}, not "
                         f"{k_pool.dtype} / {v_pool.dtype}")
    if quantized and any(s.shape != k_pool.shape[:3] or s.dtype != int8.SCALE_DTYPE
                         for s in (k_scales, v_scales)):
        raise ValueError(f"scales must be {k_pool.shape[:3]} {int8.SCALE_DTYPE}")
    for ids in (slot_blocks, slot_offsets):
        if ids.shape != (rows,) or ids.dtype != mx.int32:
            raise ValueError(f"slot ids must be int32 [{rows}], got {ids.dtype} {ids.shape}")
    if scale.shape != (1,) or scale.dtype != mx.float32:
        raise ValueError(f"scale must be float32 [1], got {scale.dtype} {scale.shape}")
    src = sources or KERNELS.sources()
    pools = (k_pool, v_pool, k_scales, v_scales) if quantized else (k_pool, v_pool)
    return [Launch(
        kernel=src[STORE_Q8 if quantized else STORE],
        inputs=(keys, values, slot_blocks, slot_offsets, *pools, scale),
        template=(("T", keys.dtype), ("D", head_dim)),
        grid=(32 * 2 * rows * kv_heads, 1, 1),
        threadgroup=(THREADS_PER_BLOCK, 1, 1),
        output_shapes=((1,),),
        output_dtypes=(mx.float32,),
        in_place=tuple(range(4, 4 + len(pools))),
    )]


#: Store plans by shape (the engine writes every layer of every step).
STORES = PlanCache(KERNELS)


def store_kv(keys: mx.array, values: mx.array, slot_blocks: mx.array, slot_offsets: mx.array,
             k_pool: mx.array, v_pool: mx.array, scale: mx.array,
             k_scales: mx.array | None = None, v_scales: mx.array | None = None) -> mx.array:
    """``plan_store`` run on CUDA: the rows written into the pool in place; returns
    ``scale`` passed on, which the layer's attention kernels must read (the module's
    docstring says why)."""
    args = (keys, values, slot_blocks, slot_offsets, k_pool, v_pool, scale, k_scales, v_scales)
    key = (keys.shape, keys.dtype, k_pool.shape, k_pool.dtype, k_scales is not None)
    return STORES.run(key, args, lambda: plan_store(*args))


def quantize_kv_cuda(keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
    """(k_q, k_scales, v_q, v_scales) of one layer's rows, by the CUDA kernel."""
    return tuple(KERNELS.run(plan_quantize(keys, values))[0])


def cuda_kernels_run() -> bool:
    """Whether this thread's default device is MLX's CUDA backend (where these kernels run)."""
    return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()


def quantize_kv(keys: mx.array, values: mx.array, use_kernel: bool) -> tuple[mx.array, ...]:
    """(k_q, k_scales, v_q, v_scales) for an 8-bit pool's scatters: the CUDA kernel when
    ``use_kernel`` (the caller has checked ``cuda_kernels_run``) and the rows fit it, else
    ``int8.quantize_kv``."""
    if use_kernel and keys.dtype in ROW_DTYPES and keys.shape[-1] in HEAD_DIMS:
        return quantize_kv_cuda(keys, values)
    return int8.quantize_kv(keys, values)
