"""PagedChat's inference engine: many chats on one paged KV pool, batched by one thread.

The public API (ARCHITECTURE.md 3.6); other code uses only these names. No Qt here.
"""

from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.events import (
    Counters,
    Event,
    FinalEvent,
    FinishReason,
    ModelInfo,
    PoolSnapshot,
    SequenceState,
    SessionStats,
    TokenEvent,
    Usage,
)
from engine.handle import RequestHandle
from engine.models import ModelLoadError

__all__ = [
    "Counters",
    "Engine",
    "EngineConfig",
    "Event",
    "FinalEvent",
    "FinishReason",
    "ModelInfo",
    "ModelLoadError",
    "PoolSnapshot",
    "RequestHandle",
    "SamplingParams",
    "SequenceState",
    "SessionStats",
    "TokenEvent",
    "Usage",
]
