"""PagedChat's inference engine: many chats on one paged KV pool, batched by one thread.

The public API (docs/ARCHITECTURE.md §3.9); other code uses only these names. No Qt here.
"""

from engine.config import (
    BLOCK_SIZES,
    DEFAULT_REPETITION_CONTEXT,
    KV_PRECISIONS,
    MAX_BEAM_WIDTH,
    REPO_ID_PATTERN,
    Constraint,
    EngineConfig,
    Priority,
    SamplingParams,
    blocks_for_budget,
    looks_like_repo_id,
)
from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.events import (
    ContextResidency,
    Counters,
    DiskStats,
    EngineStatus,
    Event,
    FinalEvent,
    FinishReason,
    ModelInfo,
    PoolSnapshot,
    SequenceState,
    SessionStats,
    TokenEvent,
    TokenLogprob,
    ToolCallFormat,
    Usage,
)
from engine.handle import RequestHandle
from engine.models.default_model import DEFAULT_NAME as DEFAULT_MODEL_NAME
from engine.models.default_model import cache_dir, locate_default_gguf
from engine.models.folder import context_limit
from engine.runner.architecture import PROVEN_ARCHITECTURES

__all__ = [
    "BLOCK_SIZES",
    "KV_PRECISIONS",
    "MAX_BEAM_WIDTH",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_REPETITION_CONTEXT",
    "PROVEN_ARCHITECTURES",
    "REPO_ID_PATTERN",
    "Constraint",
    "ContextResidency",
    "Counters",
    "DiskStats",
    "Engine",
    "EngineConfig",
    "EngineStatus",
    "Event",
    "FinalEvent",
    "FinishReason",
    "ModelInfo",
    "ModelLoadError",
    "PoolSnapshot",
    "Priority",
    "RequestHandle",
    "SamplingParams",
    "SequenceState",
    "SessionStats",
    "TokenEvent",
    "TokenLogprob",
    "ToolCallFormat",
    "Usage",
    "blocks_for_budget",
    "cache_dir",
    "context_limit",
    "locate_default_gguf",
    "looks_like_repo_id",
]
