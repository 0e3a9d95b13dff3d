"""What the engine thread hands to other threads: stream events and pool snapshots.

Everything here is immutable, so the GUI (or any consumer) can read it at its own pace
without locks. Every event carries its request and session ids, so output can never land
in the wrong chat.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


class EngineStatus(StrEnum):
    """Where the engine is in its life: ``loading`` until the model is up, then ``ready``;
    ``error`` when loading failed (``Engine.load_error`` says why)."""

    STOPPED = "stopped"
    LOADING = "loading"
    READY = "ready"
    ERROR = "error"


class SequenceState(StrEnum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    time_to_first_token_s: float | None
    total_time_s: float
    decode_tokens_per_s: float
    #: Of ``cached_prompt_tokens``, those read back from the disk tier (§3.14).
    disk_prompt_tokens: int = 0


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes a tool call (mlx-lm's tool parser for its chat template): the
    text between ``start`` and ``end`` is one call, and ``parse(text, tools)`` gives
    ``{"name": ..., "arguments": ...}``."""

    start: str
    end: str
    parse: Callable[[str, Any], dict]


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (the log-softmax of its raw logits)
    and, when asked for, the most likely tokens at that position with theirs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """A piece of streamed output for one sample (index) of one request."""

    request_id: str
    session_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    #: One entry per token of ``token_ids`` when the request asked for ``logprobs`` (none
    #: for the end-of-sequence token, which is not part of the reply's text).
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class FinalEvent:
    """The last event of one sample; `text` is the whole reply of that sample.

    error: why it failed (finish_reason ``error`` only).
    detail: why a normal stop happened where the reason alone does not say it, for the
        user (e.g. ``length`` because the reply filled the KV pool, not max_tokens).
    score: a beam search's hypothesis score (summed log-probability / generated length **
        length_penalty; index 0 is the best); None for sampled and greedy replies.
    """

    request_id: str
    session_id: str
    index: int
    finish_reason: FinishReason
    text: str
    usage: Usage
    error: str | None = None
    detail: str | None = None
    score: float | None = None


Event = TokenEvent | FinalEvent


@dataclass(frozen=True)
class SessionStats:
    session_id: str
    state: SequenceState
    blocks_held: int
    blocks_shared: int
    tokens_in_context: int
    wasted_slots: int
    tokens_per_s: float
    requests: int
    #: Prompt progress of the chat's requests still being prefilled (0/0 when none): K/V
    #: computed so far (prefix-cache hits included) and the tokens to compute in all.
    prompt_tokens_done: int = 0
    prompt_tokens_total: int = 0
    #: The highest priority of the chat's live requests (engine.Priority's value), and why
    #: its waiting request waits ("" when nothing of it waits): the monitor shows both.
    priority: int = 1
    waiting_reason: str = ""
    #: An incognito chat: its blocks are private and zeroed when released (§3.14).
    incognito: bool = False


@dataclass(frozen=True)
class DiskStats:
    """The disk tier under the pool (docs/ARCHITECTURE.md §3.14), for the monitor and
    Settings: what it holds (every model's files count against one budget), what it did,
    and the first error the user must be told about ("" when none)."""

    folder: str
    budget_bytes: int
    bytes: int
    files: int
    blocks: int  # files of the loaded model, which it can read back
    hits: int  # blocks read back into the pool instead of recomputed
    reads: int  # prompts whose blocks were looked up on disk
    writes: int  # blocks written
    discarded: int  # damaged, foreign or truncated files deleted unused
    errors: int
    error: str = ""
    writable: bool = True


@dataclass(frozen=True)
class ContextResidency:
    """Where a conversation's context is (``Engine.context_residency``): of its full blocks,
    the leading ones in the pool's prefix cache, then those on the disk tier; the rest
    would be computed again (``state`` sums it up for the sidebar)."""

    blocks: int
    in_memory: int
    on_disk: int

    @property
    def state(self) -> str:
        """"memory" (it continues at once), "disk" (asleep: read back, no prefill) or
        "recompute" (some of it would be read again by the model).

        The last full block does not count: a reply's final token (its end-of-turn, or the
        last one a token limit allowed) is sampled but never read by the model, so when it
        falls in the last full block that block is never cached, and the next turn reads
        its few tokens with the new message at no perceptible cost. Counting it showed a
        chat that had just answered as "needs reading again" (one chat in eight)."""
        needed = self.blocks - 1
        if self.in_memory >= needed:
            return "memory"
        if self.in_memory + self.on_disk >= needed:
            return "disk"
        return "recompute"


@dataclass(frozen=True)
class Counters:
    steps: int
    batch_size: int
    step_time_ms: float
    schedule_time_ms: float
    preemptions: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    tokens_per_s: float
    generated_tokens: int
    #: The step's time split (EMAs, ms); schedule_time_ms is scheduling plus bookkeeping.
    build_time_ms: float = 0.0
    forward_time_ms: float = 0.0
    sample_time_ms: float = 0.0
    bookkeeping_time_ms: float = 0.0
    #: Speculative decoding (docs/ARCHITECTURE.md §3.13): draft tokens verified, those
    #: accepted (tokens gained over one per sequence and step), and the sequence-steps that
    #: verified drafts.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    verify_rows: int = 0

    @property
    def draft_acceptance(self) -> float:
        """The share of draft tokens accepted (0.0 before any was verified)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


@dataclass(frozen=True)
class PoolSnapshot:
    """The pool at one instant. Per-block data are parallel tuples indexed by block id.

    owners[b]: session ids of the sequences holding block b (empty when free or cached).
    refcounts[b]: number of block tables holding b.
    fills[b]: slots of b that hold a token.
    cached[b]: b holds a full, hashed prefix block (reusable by a later prompt).
    block_tokens[b]: the token ids stored in b (for tooltips; decode with Engine.decode).
    """

    time: float
    block_size: int
    num_blocks: int
    bytes_per_block: int
    owners: tuple[tuple[str, ...], ...]
    refcounts: tuple[int, ...]
    fills: tuple[int, ...]
    cached: tuple[bool, ...]
    block_tokens: tuple[tuple[int, ...], ...]
    sessions: Mapping[str, SessionStats]
    counters: Counters
    model_name: str = ""
    #: False when the model runs on mlx-lm's own cache (engine/runner/fallback.py): there is no
    #: block pool then (num_blocks 0), only the sessions and counters are meaningful.
    paged: bool = True
    kv_dtype: str = ""  # the pool's element type ("bfloat16", "int8", ...), which sizes a block
    #: What a block would take at the model's own K/V dtype: more than ``bytes_per_block``
    #: in an 8-bit pool (the difference, per used block, is the memory 8-bit saves); 0 when
    #: not known.
    full_bytes_per_block: int = 0
    #: The disk tier's state, or None when it is off (no ``EngineConfig.disk_cache_dir``).
    disk: DiskStats | None = None

    @property
    def saved_bytes(self) -> int:
        """Bytes the used blocks would take more at the model's own precision (8-bit pool)."""
        extra = max(0, self.full_bytes_per_block - self.bytes_per_block)
        return self.used_blocks * extra

    def __post_init__(self) -> None:
        if not isinstance(self.sessions, MappingProxyType):
            object.__setattr__(self, "sessions", MappingProxyType(dict(self.sessions)))

    @property
    def used_blocks(self) -> int:
        return sum(1 for r in self.refcounts if r > 0)

    @property
    def cached_free_blocks(self) -> int:
        return sum(1 for r, c in zip(self.refcounts, self.cached) if r == 0 and c)

    @property
    def free_blocks(self) -> int:
        return sum(1 for r, c in zip(self.refcounts, self.cached) if r == 0 and not c)

    @property
    def shared_blocks(self) -> int:
        return sum(1 for r in self.refcounts if r > 1)

    @property
    def held_slots(self) -> int:
        return sum(f for r, f in zip(self.refcounts, self.fills) if r > 0)

    @property
    def waste_fraction(self) -> float:
        """Allocated slots not holding a token, over all allocated slots."""
        used = self.used_blocks
        if not used:
            return 0.0
        return 1.0 - self.held_slots / (used * self.block_size)


@dataclass(frozen=True)
class ModelInfo:
    """What the loaded model and its pool look like (for the UI)."""

    name: str
    model_type: str
    max_context: int
    block_size: int
    num_blocks: int
    bytes_per_block: int
    attention: str  # "cuda-paged", "metal-kernel", "cpu-paged", "reference" or "mlx-lm" (not paged)
    path: str = ""  # the model folder (its generation_config.json gives sampling defaults)
    #: The K/V element type: the model's own (bf16 weights give a bf16 pool), so the MiB
    #: per block follow the weights, not the compute dtype chosen for the default model.
    kv_dtype: str = "float32"
    #: What a block would take at the model's own K/V dtype (= ``bytes_per_block`` unless
    #: the pool is 8-bit, ``kv_dtype`` "int8"; issue #26).
    full_bytes_per_block: int = 0
    #: What a block takes in an 8-bit pool (whichever the pool is): with
    #: ``full_bytes_per_block``, what the app's KV precision choice buys.
    int8_bytes_per_block: int = 0
    #: False: the architecture failed the paged check and runs on mlx-lm's BatchGenerator
    #: (continuous batching without paging); ``not_paged_reason`` says why.
    paged: bool = True
    not_paged_reason: str = ""
