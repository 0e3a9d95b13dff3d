"""An 8-bit pool's write, quantized in one kernel launch on CUDA (``shaders/kv_write.cu``).

Why: ``engine.kv.int8.quantize`` is a dozen MLX ops for K and again for V; on a GPU each is
a kernel launch in every layer of every step. Measured on an H100 (scripts/gpu/kv_write_cost.py,
8B shape, 64 rows, 32 layers) a step's 8-bit writes cost 5.2 ms against 0.67 ms for a bf16
pool's two scatters, and 2.5 ms with the quantizer under ``mx.compile``. The kernel quantizes
a layer's K and V rows in one launch, with the same arithmetic (the emulator and the GPU check
compare its bytes with ``int8.quantize``'s); the pool's four scatters stay MLX's, in place.

``quantize_kv`` picks the kernel where it runs (MLX's CUDA backend, the engine's kernel path)
and ``int8.quantize_kv`` (the MLX formulation, compiled) elsewhere. As with the attention
kernels, a call is a *launch plan* (``plan_quantize``), which the CPU emulation harness
(tests/kernel_emulation/cuda_generator.py) executes too.
"""

from __future__ import annotations

import mlx.core as mx

from engine.attention.plans import HEAD_DIMS, KernelSet, Launch, shaders_root
from engine.kv import int8

WRITE_SHADER_PATH = shaders_root() / "shaders" / "kv_write.cu"
THREADS_PER_BLOCK = 256  # 8 warps, one (row, KV head) of K or V each
KERNEL = "kv_quantize"
ROW_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

KERNELS = KernelSet("cuda_kernel", WRITE_SHADER_PATH, None, None, "CUDA K/V write source",
                    signatures={KERNEL: (("keys", "values"),
                                         ("k_q", "k_scales", "v_q", "v_scales"))})


def plan_quantize(keys: mx.array, values: mx.array, sources=None) -> list[Launch]:
    """The launch quantizing ``keys`` and ``values`` ([rows, kv_heads, head_dim], one float
    dtype) into (k_q, k_scales, v_q, v_scales) as ``int8.quantize`` does; ``sources``: another
    version of the shader file's kernels (tests)."""
    if keys.ndim != 3 or keys.shape != values.shape:
        raise ValueError(f"K/V rows must share a [rows, kv_heads, head_dim] shape, got "
                         f"{keys.shape} and {values.shape}")
    if keys.dtype != values.dtype or keys.dtype not in ROW_DTYPES:
        raise ValueError(f"K/V rows of {keys.dtype} / {values.dtype}: the kernel takes one of "
                         f"{ROW_DTYPES}")
    rows, kv_heads, head_dim = keys.shape
    if head_dim not in HEAD_DIMS or rows * kv_heads == 0:
        raise ValueError(f"K/V rows {keys.shape}: head_dim in {HEAD_DIMS}, no empty dimension")
    src = sources or KERNELS.sources()
    items = 2 * rows * kv_heads
    return [Launch(
        kernel=src[KERNEL],
        inputs=(keys, values),
        template=(("T", keys.dtype), ("D", head_dim)),
        grid=(32 * items, 1, 1),
        threadgroup=(THREADS_PER_BLOCK, 1, 1),
        output_shapes=(keys.shape, (rows, kv_heads), keys.shape, (rows, kv_heads)),
        output_dtypes=(int8.INT8, int8.SCALE_DTYPE, int8.INT8, int8.SCALE_DTYPE),
    )]


def quantize_kv_cuda(keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
    """(k_q, k_scales, v_q, v_scales) of one layer's rows, by the CUDA kernel."""
    return tuple(KERNELS.run(plan_quantize(keys, values))[0])


def quantize_kv(keys: mx.array, values: mx.array, use_kernel: bool) -> tuple[mx.array, ...]:
    """(k_q, k_scales, v_q, v_scales): the CUDA kernel when ``use_kernel`` on MLX's CUDA
    backend and the rows fit it, else ``int8.quantize_kv``."""
    if (use_kernel and keys.dtype in ROW_DTYPES and keys.shape[-1] in HEAD_DIMS
            and mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()):
        return quantize_kv_cuda(keys, values)
    return int8.quantize_kv(keys, values)
