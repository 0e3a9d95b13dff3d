"""Load wiring: from an ``EngineConfig`` to every object one loaded model's engine runs on.

Loading is the one place where the engine's parts meet: the model decides the pool's shape,
the memory budget its block count, the backend the attention path, and the scheduler, the
output and the step runner are bound to that pool. Building all of them here, in one
function that returns one ``Runtime``, keeps the engine thread's shell (engine/engine.py)
free of wiring, and makes a restart a matter of dropping one reference.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from engine.attention import cpu_kernel
from engine.attention import dispatch as attention
from engine.config import EngineConfig, blocks_for_budget, overlap_steps, speculative_drafts
from engine.errors import ModelLoadError, NotPaged
from engine.events import ModelInfo
from engine.kv import disk_format
from engine.kv.blocks import BlockAllocator
from engine.kv.disk_tier import DiskTier
from engine.kv.pool import KVPool, KVShape
from engine.memory import check_fits
from engine.models.folder import LoadedModel, dtype_name
from engine.models.resolve import load_model
from engine.runner import fallback
from engine.runner.architecture import query_heads, supported_kv_shape, verify_architecture
from engine.runner.disk_sync import DiskSync
from engine.runner.model_adapter import PagedModel, warm_gathered_prefill
from engine.runner.output import Output
from engine.runner.step import StepRunner
from engine.runner.step_batch import bucket_below
from engine.runner.telemetry import Telemetry
from engine.sched.prefill_budget import MIN_PROMPT_TOKENS, PrefillBudget
from engine.sched.scheduler import Scheduler
from engine.sched.speculation import Speculator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    """What the engine thread serves with, for one loaded model (the thread's alone, except
    ``loaded.tokenizer``, which callers' threads use to count and encode tokens). A model
    the pool cannot run has no pool and no paged model: the fallback's scheduler and
    runner stand in (``model_info.paged`` is False)."""

    loaded: LoadedModel
    pool: KVPool | None
    alloc: BlockAllocator | fallback.NoPool
    scheduler: Scheduler | fallback.FallbackScheduler
    paged_model: PagedModel | None
    output: Output
    stepper: StepRunner | fallback.FallbackRunner
    max_context: int
    model_info: ModelInfo
    #: The disk tier under the pool (engine/runner/disk_sync.py), or None when off.
    disk: DiskSync | None = None


def weights_nbytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (for the memory check before the pool exists)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def kv_quantized(precision: str, shape: KVShape, budget_mib: float, max_batch: int,
                 max_context: int) -> bool:
    """Whether the pool stores K/V as int8 (``EngineConfig.kv_precision``). "auto" quantizes
    when the budget, at the model's own precision, cannot hold ``max_batch`` chats of
    ``max_context`` tokens: then 8-bit blocks are chats the user would otherwise not fit
    (quality measured in bench/results/kv8.md); when everything fits, the model's own."""
    if precision != "auto":
        return precision == "int8"
    full = replace(shape, quantized=False)
    return full.bytes_per_token() * max_batch * max_context > budget_mib * 2**20


def load_runtime(cfg: EngineConfig, telemetry: Telemetry,
                 wake: Callable[[], None] | None = None) -> Runtime:
    """Load ``cfg.model`` and build the pool and everything bound to it.

    Every refusal (a model that cannot load, a budget the machine cannot hold) is a
    ``ModelLoadError`` that says what to do, raised before the pool is allocated; an
    architecture the paged path cannot run gets the fallback runtime instead."""
    loaded = load_model(cfg.model, cfg.quantized)
    max_context = min(cfg.max_context or loaded.max_context, loaded.max_context)
    try:
        shape = supported_kv_shape(loaded, max_context)
        verify_architecture(loaded, shape, cfg.block_size)
    except NotPaged as reason:  # mlx-lm's own batching serves it, unpaged
        return _fallback_runtime(cfg, telemetry, loaded, max_context, str(reason))
    full_bytes_per_block = shape.bytes_per_token() * cfg.block_size  # at the model's own dtype
    if kv_quantized(cfg.kv_precision, shape, cfg.kv_memory_mib, cfg.max_batch, max_context):
        shape = replace(shape, quantized=True)
    num_blocks = blocks_for_budget(shape.bytes_per_token(), cfg.block_size, cfg.kv_memory_mib)
    try:
        check_fits(num_blocks * shape.bytes_per_token() * cfg.block_size,
                   weights_nbytes(loaded.model))
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    use_kernel = cfg.attention == "kernel" or (
        cfg.attention == "auto" and attention.kernel_available()
    )
    pool = KVPool(shape, num_blocks, cfg.block_size)
    # Where no GPU kernel runs, "auto" takes the compiled CPU kernel when it builds here.
    on_cpu_kernel = (cfg.attention == "auto" and not use_kernel and attention.on_cpu()
                     and cpu_kernel.supports(pool.keys[0].dtype, cfg.block_size,
                                           shape.head_dim) and cpu_kernel.ready())
    alloc = BlockAllocator(num_blocks, cfg.block_size)
    scheduler = Scheduler(alloc, cfg.max_batch, cfg.prefill_chunk)
    paged_model = PagedModel(loaded.model, pool, use_kernel=use_kernel,
                             cpu_kernel=on_cpu_kernel)
    if use_kernel and attention.kernel_path() == "cuda-paged":
        start = time.perf_counter()
        warmed = warm_gathered_prefill(pool, query_heads(loaded.model), cfg.prefill_chunk,
                                       max_context)
        if warmed:
            logger.info("gathered prefill: %d attention shapes built in %.2f s", warmed,
                        time.perf_counter() - start)
    output = Output(telemetry, set(loaded.tokenizer.eos_token_ids), max_context)
    on_gpu = mx.default_device() == mx.gpu
    # a GPU plans (graphs, matmuls) per token count: chunks keep to bucketed sizes there
    prefill = PrefillBudget(cfg.prefill_chunk, MIN_PROMPT_TOKENS, cfg.prefill_target,
                            floor=bucket_below if on_gpu else None)
    overlap = overlap_steps(cfg, on_gpu)
    stepper = StepRunner(scheduler, pool, paged_model, output, telemetry, prefill,
                         overlap=overlap,
                         speculator=Speculator(enabled=speculative_drafts(cfg, overlap),
                                               overlapped=overlap))
    info = ModelInfo(
        name=loaded.name,
        model_type=loaded.model_type,
        max_context=max_context,
        block_size=cfg.block_size,
        num_blocks=num_blocks,
        bytes_per_block=pool.bytes_per_block,
        attention=((attention.kernel_path() or "reference") if use_kernel
                   else "cpu-paged" if on_cpu_kernel else "reference"),
        path=str(loaded.path),
        kv_dtype=kv_dtype_name(shape),
        full_bytes_per_block=full_bytes_per_block,
        int8_bytes_per_block=replace(shape, quantized=True).bytes_per_token() * cfg.block_size,
    )
    disk = None
    if cfg.disk_cache_dir is not None:
        disk = stepper.disk = DiskSync(open_disk_tier(cfg, loaded, pool, wake), pool,
                                       alloc, scheduler)
    return Runtime(loaded, pool, alloc, scheduler, paged_model, output, stepper, max_context,
                   info, disk)


def block_layout(pool: KVPool) -> disk_format.BlockLayout:
    """How one of ``pool``'s blocks is laid out on the host (and in its file)."""
    shape = pool.shape
    return disk_format.BlockLayout(shape.num_layers, pool.block_size, shape.num_kv_heads,
                                   shape.head_dim, pool.host_dtype(shape.storage_dtype),
                                   shape.quantized)


def open_disk_tier(cfg: EngineConfig, loaded: LoadedModel, pool: KVPool,
                   wake: Callable[[], None] | None) -> DiskTier:
    """The disk tier for this model and pool: its folder is named by the fingerprint of
    everything a stored block depends on (engine/kv/disk_format.py)."""
    layout = block_layout(pool)
    template = getattr(loaded.tokenizer, "chat_template", None) or ""
    fp = disk_format.fingerprint(Path(loaded.path), dtype_name(loaded.dtype), layout,
                                 str(template), kv_dtype_name(pool.shape))
    return DiskTier(Path(cfg.disk_cache_dir).expanduser(), fp, layout,
                    int(cfg.disk_budget_mib * 2**20), wake)


def kv_dtype_name(shape: KVShape) -> str:
    """What the pool stores: "int8" for an 8-bit pool, else the model's K/V dtype."""
    return "int8" if shape.quantized else dtype_name(shape.dtype)


def _fallback_runtime(cfg: EngineConfig, telemetry: Telemetry, loaded: LoadedModel,
                      max_context: int, reason: str) -> Runtime:
    """The same loop, Output and API on mlx-lm's BatchGenerator instead of the pool
    (engine/runner/fallback.py)."""
    try:
        check_fits(0, weights_nbytes(loaded.model))
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    logger.info("%s runs on mlx-lm's own cache: %s", loaded.model_type, reason)
    alloc = fallback.NoPool(cfg.block_size)
    scheduler = fallback.FallbackScheduler(cfg.max_batch)
    output = Output(telemetry, set(loaded.tokenizer.eos_token_ids), max_context)
    stepper = fallback.FallbackRunner(loaded.model, scheduler, output, telemetry, max_context,
                                      cfg.prefill_chunk)
    info = ModelInfo(
        name=loaded.name, model_type=loaded.model_type, max_context=max_context,
        block_size=cfg.block_size, num_blocks=0, bytes_per_block=0,
        attention=fallback.ATTENTION_NAME, path=str(loaded.path),
        kv_dtype=dtype_name(loaded.dtype), paged=False, not_paged_reason=reason,
    )
    return Runtime(loaded, None, alloc, scheduler, None, output, stepper, max_context, info)
