"""Which mlx-lm architectures may run on the paged pool: proven by test, or checked at load.

The paged path (engine/runner/model_adapter.py) hooks into mlx-lm by its extension points, so an
architecture whose attention goes around them would answer wrongly rather than fail. This
module keeps that from ever reaching a user: the architectures in ``PROVEN_ARCHITECTURES``
are proven by ``tests/test_architectures.py``; any other is run once at load through the
paged path and through mlx-lm's own cache, and sent to the fallback engine (``NotPaged``,
engine/runner/fallback.py) when the two disagree. Models that hold no attention K/V at all
(state-space layers) or attend through a sliding window go there by name before anything
runs. Kept apart from the adapter because it runs once per load, never in a
step.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

from engine.errors import NotPaged
from engine.kv.pool import KVPool, KVShape
from engine.models.folder import LoadedModel
from engine.runner.model_adapter import PagedModel
from engine.runner.step_batch import build_step_batch
from engine.sched.work import SequenceWork

logger = logging.getLogger(__name__)

PROVEN_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma")


class _ShapeProbe:
    """A cache that records the K/V shape each layer produces (one token, no pool)."""

    def __init__(self) -> None:
        self.offset = 0
        self.seen: tuple[int, int, mx.Dtype] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.seen = (keys.shape[1], keys.shape[3], keys.dtype)
        return keys, values


def recurrent_caches(model: nn.Module) -> list[str]:
    """Names of the cache types the model asks mlx-lm for that hold a recurrent state
    rather than attention K/V (state-space layers: mamba, hybrids). The paged pool only
    holds K/V, so a model with any is refused at load, by name, before it is run."""
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        return []  # mlx-lm gives it plain KVCaches
    from mlx_lm.models.cache import ArraysCache, CacheList

    return sorted({type(c).__name__ for c in make_cache()
                   if isinstance(c, ArraysCache | CacheList)})


def probe_kv_shape(model: nn.Module) -> KVShape:
    """Run one token through the model to learn its per-layer K/V shape and dtype."""
    layers = model.layers
    probes = [_ShapeProbe() for _ in layers]
    mx.eval(model(mx.array([[0]], dtype=mx.int32), cache=probes))
    shapes = {p.seen for p in probes}
    if None in shapes or len(shapes) != 1:
        raise ValueError("the model's layers do not share one K/V shape; the paged path needs it")
    kv_heads, head_dim, dtype = shapes.pop()
    return KVShape(num_layers=len(layers), num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)


def query_heads(model: nn.Module) -> int | None:
    """The model's attention (query) heads as its mlx-lm arguments name them, or None where
    they do not (the K/V probe sees keys and values only)."""
    args = getattr(model, "args", None)
    for name in ("num_attention_heads", "n_heads", "num_heads"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_paged_matches(model: nn.Module, shape: KVShape, block_size: int) -> float:
    """Run a short prompt and three decode steps through the paged path and through mlx-lm's
    own cache; return the largest logit difference relative to the logits' scale.

    Used at load time for architectures outside PROVEN_ARCHITECTURES: one that agrees runs
    paged; one that does not is refused with a clear message instead of answering wrongly.
    """
    from mlx_lm.models.cache import make_prompt_cache

    from engine.kv.block_table import BlockTable
    from engine.kv.blocks import BlockAllocator

    prompt = [(7 * i + 3) % 100 + 1 for i in range(2 * block_size + 3)]
    feeds = [prompt, [11], [12], [13]]
    cache = make_prompt_cache(model)
    pool = KVPool(shape, 8, block_size)
    alloc = BlockAllocator(8, block_size)
    paged = PagedModel(model, pool)
    table = BlockTable(owner="check")
    worst = 0.0
    for tokens in feeds:
        expected = model(mx.array([tokens]), cache=cache)[0, -1].astype(mx.float32)
        start = table.num_tokens
        slots = alloc.append(table, tokens).slots
        got = paged.forward(build_step_batch([SequenceWork(tokens, start, table.blocks, slots)]))
        alloc.mark_computed(table)
        diff = mx.abs(got[0].astype(mx.float32) - expected).max()
        scale = mx.maximum(mx.abs(expected).max(), 1.0)
        worst = max(worst, (diff / scale).item())
    return worst


def sliding_windows(model: nn.Module) -> list[int]:
    """The attention windows of the model's sliding-window layers (mlx-lm gives those a
    RotatingKVCache). The pool attends to a sequence's whole past, so such a model is only
    right on it while every sequence is shorter than its smallest window; the load-time
    check, with its short prompt, cannot see the difference."""
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        return []
    from mlx_lm.models.cache import RotatingKVCache

    return sorted({int(c.max_size) for c in make_cache() if isinstance(c, RotatingKVCache)})


def supported_kv_shape(loaded: LoadedModel, max_context: int) -> KVShape:
    """The model's per-layer K/V shape, or ``NotPaged`` saying why the pool cannot hold it:
    no attention K/V (a state-space model such as mamba), a sliding window narrower than
    the context, or layers of different K/V shapes. Such a model runs on the fallback."""
    recurrent = recurrent_caches(loaded.model)
    if recurrent:
        raise NotPaged(
            f"the {loaded.model_type!r} architecture keeps a recurrent state "
            f"({', '.join(recurrent)}) instead of attention keys and values, so it cannot "
            "run on PagedChat's paged KV pool")
    windows = [w for w in sliding_windows(loaded.model) if w < max_context]
    if windows:
        raise NotPaged(
            f"the {loaded.model_type!r} architecture uses sliding-window attention (a "
            f"window of {windows[0]} tokens), which PagedChat's paged KV pool does not model")
    try:
        return probe_kv_shape(loaded.model)
    except Exception as e:
        raise NotPaged(
            f"the {loaded.model_type!r} architecture does not run on PagedChat's paged KV "
            f"pool ({type(e).__name__}: {e})") from e


def verify_architecture(loaded: LoadedModel, shape: KVShape, block_size: int) -> None:
    """An architecture outside the proven list runs paged only if it agrees with mlx-lm's
    own cache on a short check; otherwise it is not paged (never run wrongly)."""
    if loaded.model_type in PROVEN_ARCHITECTURES:
        return
    tolerance = 1e-3 if shape.dtype == mx.float32 else 3e-2
    try:
        error = check_paged_matches(loaded.model, shape, block_size)
    except Exception as e:  # e.g. attention sinks: the paged router refuses them
        raise NotPaged(
            f"the {loaded.model_type!r} architecture does not run on PagedChat's paged KV "
            f"pool ({type(e).__name__}: {e})") from e
    if error > tolerance:
        raise NotPaged(
            f"the {loaded.model_type!r} architecture does not run on PagedChat's paged KV "
            f"pool (its output differs from mlx-lm's by {error:.1e})")
    logger.info("%s verified on the paged path (max rel. diff %.1e)", loaded.model_type, error)
