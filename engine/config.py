"""Validated settings for the engine and for one request.

Validation happens here, at construction, so a bad value fails in the caller's thread with a
clear message instead of deep inside the engine thread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: Token slots per KV block that the engine (and its attention kernels) support.
BLOCK_SIZES = (8, 16, 32)

#: What the Hugging Face Hub accepts as a repo id ("owner/name"); anything else names a path.
REPO_ID_PATTERN = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

MIB = 2**20


def looks_like_repo_id(spec: str) -> bool:
    """True for "owner/name" (what the Hub accepts); anything else is meant as a path."""
    return REPO_ID_PATTERN.fullmatch(spec) is not None


def blocks_for_budget(bytes_per_token: int, block_size: int, budget_mib: float) -> int:
    """How many blocks of ``block_size`` slots fit in ``budget_mib`` (at least one).

    One function for the engine (sizing the pool) and the app (showing what a budget buys),
    so the two can never disagree.
    """
    per_block = bytes_per_token * block_size
    return max(1, int(budget_mib * MIB) // per_block)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine loads its model and sizes its KV pool.

    model: "default" (the embedded SmolLM2-135M-Instruct), a local mlx-lm folder, or a
        Hugging Face repo id.
    kv_memory_mib: KV pool budget; the pool is allocated once from it and never grows.
    block_size: token slots per block (8, 16 or 32).
    max_batch: most sequences decoded in one step.
    prefill_chunk: most prompt tokens processed in one step, so a long prompt never stalls
        the running chats for long.
    max_context: per-sequence limit; None means the model's own limit.
    quantized: keep quantized weights (None = decide by backend: yes on Metal, no on CPU).
    """

    model: str = "default"
    kv_memory_mib: float = 256.0
    block_size: int = 16
    max_batch: int = 16
    prefill_chunk: int = 256
    max_context: int | None = None
    quantized: bool | None = None
    attention: str = "auto"  # "auto", "reference" or "kernel"

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(
                f"block_size must be one of {BLOCK_SIZES}, got {self.block_size}"
            )
        if not self.kv_memory_mib > 0:
            raise ValueError(f"kv_memory_mib must be positive, got {self.kv_memory_mib}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.prefill_chunk < self.block_size:
            raise ValueError("prefill_chunk must be at least one block")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError("max_context must be at least 2 tokens")
        if self.attention not in ("auto", "reference", "kernel"):
            raise ValueError(f"attention must be auto, reference or kernel, got {self.attention!r}")
        if not self.model:
            raise ValueError("model must name 'default', a folder or a Hugging Face repo id")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; temperature 0 means greedy."""

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 1 <= self.n <= 8:
            raise ValueError(f"n must be between 1 and 8, got {self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
