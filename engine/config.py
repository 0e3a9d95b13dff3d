"""Validated settings for the engine and for one request.

Validation happens here, at construction, so a bad value fails in the caller's thread with a
clear message instead of deep inside the engine thread.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass, field
from enum import IntEnum

from engine.memory import DEFAULT_BUDGET_MIB, check_kv_budget

#: Token slots per KV block that the engine (and its attention kernels) support.
BLOCK_SIZES = (8, 16, 32)

#: What the Hugging Face Hub accepts as a repo id ("owner/name"); anything else names a path.
REPO_ID_PATTERN = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

MIB = 2**20

#: How the KV pool stores K and V (``EngineConfig.kv_precision``): "model" keeps the model's
#: own K/V dtype (bf16/fp16 for 16-bit weights, fp32 for the embedded model on the CPU);
#: "int8" stores int8 with one fp16 scale per token and KV head (engine/kv/int8.py); "auto"
#: picks int8 when the budget cannot hold ``max_batch`` chats of the model's full context at
#: the model's own precision (engine/loading.py ``kv_quantized``), else "model".
KV_PRECISIONS = ("auto", "model", "int8")

#: The disk tier's default budget (``EngineConfig.disk_budget_mib``): a few GB, about 5,700
#: blocks of the default model's fp32 pool (16 tokens each), a 90k-token history.
DEFAULT_DISK_BUDGET_MIB = 4096


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
    kv_memory_mib: KV pool budget; the pool is allocated once from it and never grows. It
        is checked against this machine's memory here (engine/memory.py), and again with
        the model's weights once they are loaded, before the pool is allocated.
    block_size: token slots per block (8, 16 or 32).
    max_batch: most sequences decoded in one step.
    prefill_chunk: most prompt tokens processed in one step (a prompt alone gets this much).
    prefill_target: while any chat decodes, a step that also runs prompt tokens aims at this
        multiple of a pure decode step (engine/sched/prefill_budget.py); 0 turns the adaptive
        budget off and every step takes up to ``prefill_chunk`` prompt tokens.
    overlap: launch each step before reading the previous step's tokens (mlx-lm's
        BatchGenerator does the same); False runs every step synchronously; None decides by
        backend: on a GPU the device computes while Python builds the next step, but on the
        CPU backend both compete for the same cores (8 chats, idle 2-core machine: 47 tok/s
        overlapped vs 57 synchronous), so only GPUs overlap.
    max_context: per-sequence limit; None means the model's own limit.
    quantized: keep quantized weights (None = decide by backend: yes on Metal, no on CPU).
    kv_precision: how the pool stores K/V (``KV_PRECISIONS``): "model" (the model's own
        dtype), "int8" (8-bit with per-token scales: about half the bytes of a 16-bit pool,
        a quarter of fp32's), or "auto" (int8 when the budget is short of ``max_batch`` full
        contexts at the model's own precision). The engine's default is "model" (its greedy
        replies equal mlx-lm's); the app passes the user's choice, "auto" unless changed.
    disk_cache_dir: the folder of the disk tier under the pool (full blocks kept on disk
        across evictions and restarts, docs/ARCHITECTURE.md §3.14); None turns it off.
    disk_budget_mib: the most the disk tier's files take, every model's together (the least
        recently used are deleted first).
    speculative: speculative decoding without a draft model (docs/ARCHITECTURE.md §3.13):
        decoding chats propose drafts from their own context and their siblings' replies,
        verified in the same step; each chat's draft length follows its acceptance and the
        measured cost, so drafting stops where it does not pay. Outputs are unchanged
        (greedy: the same tokens; sampled: the same distributions). False: never draft.
        None decides by backend: on where steps run synchronously (the CPU), off where they
        overlap (a GPU): a drafting step gives up the overlap there, and on the H100 drafting
        wins the editing workload (2.8-3.7x) but still loses on sampled chats in about half
        the runs (with its verify rows as decode rows: one chat 0.94-1.11x, 8 chats
        0.92-0.99x, regenerate x3 0.95-0.96x; bench/results/speculative_gpu.md, §3.13).
    """

    model: str = "default"
    kv_memory_mib: float = DEFAULT_BUDGET_MIB
    block_size: int = 16
    max_batch: int = 16
    prefill_chunk: int = 256
    prefill_target: float = 2.0
    overlap: bool | None = None
    max_context: int | None = None
    quantized: bool | None = None
    attention: str = "auto"  # "auto", "reference" or "kernel"
    kv_precision: str = "model"  # "auto", "model" or "int8" (KV_PRECISIONS)
    disk_cache_dir: str | None = None
    disk_budget_mib: float = DEFAULT_DISK_BUDGET_MIB
    speculative: bool | None = None

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(
                f"block_size must be one of {BLOCK_SIZES}, got {self.block_size}"
            )
        object.__setattr__(self, "kv_memory_mib", check_kv_budget(self.kv_memory_mib))
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.prefill_chunk < self.block_size:
            raise ValueError("prefill_chunk must be at least one block")
        if self.prefill_target != 0 and not self.prefill_target >= 1.0:
            raise ValueError(
                f"prefill_target must be 0 (off) or at least 1.0, got {self.prefill_target}"
            )
        if self.max_context is not None and self.max_context < 2:
            raise ValueError("max_context must be at least 2 tokens")
        if self.attention not in ("auto", "reference", "kernel"):
            raise ValueError(f"attention must be auto, reference or kernel, got {self.attention!r}")
        if self.kv_precision not in KV_PRECISIONS:
            raise ValueError(
                "kv_precision must be 'auto', 'model' (the model's own K/V dtype) or 'int8' "
                f"(8-bit K/V), got {self.kv_precision!r}"
            )
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise ValueError(
                f"speculative must be True, False or None (by backend), got {self.speculative!r}")
        if not self.model:
            raise ValueError("model must name 'default', a folder or a Hugging Face repo id")
        if self.disk_cache_dir is not None and not str(self.disk_cache_dir):
            raise ValueError("disk_cache_dir must be a folder path, or None to turn the disk "
                             "tier off")
        budget = self.disk_budget_mib
        if (isinstance(budget, bool) or not isinstance(budget, numbers.Real)
                or not math.isfinite(budget) or budget < 0):
            raise ValueError(f"disk_budget_mib must be a number of MiB >= 0, got {budget!r}")


#: mx.random.key takes an unsigned 64-bit seed.
SEED_RANGE = (0, 2**64 - 1)
MAX_SAMPLES = 8
#: The widest beam search (``SamplingParams.beam_width``): the beams decode side by side in
#: one batch, so the engine's ``max_batch`` also bounds it (checked at submit).
MAX_BEAM_WIDTH = 8
#: HF's ``early_stopping`` values: True stops once ``beam_width`` hypotheses are finished,
#: False (the default) when the heuristic says no live beam can beat the worst finished one,
#: "never" when that is certain (engine/sched/beams.py).
EARLY_STOPPING = (True, False, "never")
#: The most alternatives a token's log-probabilities list (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20
#: Far above any model's context, but a bound: an int this large is a typo, not a wish.
MAX_NEW_TOKENS = 1 << 20
#: The repetition penalty's window: mlx-lm's default, and a bound far above any useful one.
DEFAULT_REPETITION_CONTEXT = 20
MAX_REPETITION_CONTEXT = 1 << 16


class Priority(IntEnum):
    """Who goes first when the pool, the batch or a step's prompt budget is short
    (docs/ARCHITECTURE.md §3.3). The app sets it by what the user does: the chat in the
    focused pane and the one just sent in are INTERACTIVE, chats in other panes and API
    requests BACKGROUND; NORMAL is the default for callers that do not say."""

    BACKGROUND = 0
    NORMAL = 1
    INTERACTIVE = 2


def checked_priority(priority: object) -> Priority:
    """``priority`` as a Priority, or a ValueError naming the allowed values."""
    if isinstance(priority, bool) or not isinstance(priority, (int, Priority)):
        raise ValueError(f"priority must be a Priority ({', '.join(p.name for p in Priority)}),"
                         f" got {priority!r}")
    try:
        return Priority(priority)
    except ValueError:
        raise ValueError(f"priority must be a Priority ({', '.join(p.name for p in Priority)}),"
                         f" got {priority!r}") from None


#: What a Constraint can hold a reply to (engine/runner/constraints.py compiles each).
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "lark")


@dataclass(frozen=True)
class Constraint:
    """What a reply must match, token by token (constrained decoding): the sampler only
    draws tokens that keep the reply inside the grammar, and the reply ends where the
    grammar does.

    ``kind``: "json_schema" (``spec``: a JSON Schema, as a dict or its JSON text),
    "json_object" (any JSON object; no spec), "regex" (``spec``: the pattern the whole reply
    matches) or "lark" (``spec``: a grammar in llguidance's Lark dialect, which can embed
    JSON schemas: tool calls are built this way). The grammar itself is compiled against
    the model's tokenizer at submit, where a bad one is refused with the compiler's message.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)},"
                             f" got {self.kind!r}")
        spec = self.spec
        if self.kind == "json_schema":
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError as e:
                    raise ValueError(f"a json_schema constraint needs a JSON schema: {e}") from None
            if not isinstance(spec, dict):
                raise ValueError("a json_schema constraint needs a JSON schema object, got "
                                 f"{type(spec).__name__}")
            # property order kept: the reply follows the schema's order, as OpenAI's does
            object.__setattr__(self, "spec", json.dumps(spec))
        elif self.kind == "json_object":
            if spec not in ("", None):
                raise ValueError("a json_object constraint takes no spec")
            object.__setattr__(self, "spec", "")
        elif not isinstance(spec, str) or not spec:
            raise ValueError(f"a {self.kind} constraint needs its {self.kind} as a non-empty "
                             f"string, got {spec!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; temperature 0 means greedy.

    Every field is checked here (``top_k`` against the model's vocabulary again at
    submit): a value the sampler would choke on, or one that silently samples garbage
    (NaN, inf), is refused with a message that names the field and its allowed range.
    """

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    #: How many of the latest tokens (prompt included) the repetition penalty looks at:
    #: mlx-lm's ``repetition_context_size``. Its 20 cannot see a looping sentence longer
    #: than 20 tokens, so the app's defaults widen it.
    repetition_context_size: int = DEFAULT_REPETITION_CONTEXT
    max_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    n: int = 1
    #: Hold the reply to a grammar (None: free text). See :class:`Constraint`.
    constraint: Constraint | None = None
    #: Report each token's log-probability and this many alternatives (None: none).
    logprobs: int | None = None
    #: Beam search over this many beams (1: off, the usual sampling or greedy decoding).
    #: Above 1 the reply is the ``n`` best finished hypotheses, ranked by
    #: ``sum of log-probabilities / generated length ** length_penalty`` (Hugging Face's
    #: convention), and ends with them: no token streams before (docs/ARCHITECTURE.md §3.12).
    beam_width: int = 1
    #: The exponent of the length in a hypothesis's score (beam search only): above 0
    #: favours longer replies, below 0 shorter ones, 0 ranks by the summed log-probability.
    length_penalty: float = 1.0
    #: When beam search stops (``EARLY_STOPPING``): True, False or "never", as in HF.
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "temperature", _real("temperature", self.temperature, "a finite number >= 0",
                                       lambda v: v >= 0.0))
        put(self, "top_p", _real("top_p", self.top_p, "a number in (0, 1]",
                                 lambda v: 0.0 < v <= 1.0))
        put(self, "top_k", _integer("top_k", self.top_k, 0, None,
                                    "an integer >= 0 (0 disables it)"))
        put(self, "min_p", _real("min_p", self.min_p, "a number in [0, 1] (0 disables it)",
                                 lambda v: 0.0 <= v <= 1.0))
        put(self, "repetition_penalty", _real(
            "repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 disables it)",
            lambda v: v > 0.0))
        put(self, "repetition_context_size", _integer(
            "repetition_context_size", self.repetition_context_size, 1, MAX_REPETITION_CONTEXT))
        put(self, "max_tokens", _integer("max_tokens", self.max_tokens, 1, MAX_NEW_TOKENS))
        if self.seed is not None:
            put(self, "seed", _integer("seed", self.seed, *SEED_RANGE,
                                       "None or an integer in [0, 2**64 - 1]"))
        put(self, "n", _integer("n", self.n, 1, MAX_SAMPLES))
        put(self, "stop", _stop_strings(self.stop))
        if self.logprobs is not None:
            put(self, "logprobs", _integer("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS,
                                           f"None or an integer in [0, {MAX_TOP_LOGPROBS}]"))
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError("constraint must be None or a Constraint, got "
                             f"{type(self.constraint).__name__}")
        put(self, "beam_width", _integer("beam_width", self.beam_width, 1, MAX_BEAM_WIDTH,
                                         f"an integer in [1, {MAX_BEAM_WIDTH}] (1 turns beam "
                                         "search off)"))
        put(self, "length_penalty", _real("length_penalty", self.length_penalty,
                                          "a finite number", lambda v: True))
        if not any(self.early_stopping is v or (isinstance(v, str) and self.early_stopping == v)
                   for v in EARLY_STOPPING):
            raise ValueError("early_stopping must be true, false or \"never\", got "
                             f"{self.early_stopping!r}")
        if self.beam_width > 1:
            self._check_beam_search()

    def _check_beam_search(self) -> None:
        """Beam search keeps the most likely continuations of the model's own distribution,
        so whatever would sample, reshape or hold that distribution makes no sense with it:
        each such field is refused by name, with what to send instead."""
        k = self.beam_width
        if self.n > k:
            raise ValueError(f"n must be at most beam_width with beam search: the {k} beams "
                             f"give at most {k} replies, got n={self.n}")
        neutral = {"temperature": (0.0, "0"), "top_p": (1.0, "1"), "top_k": (0, "0"),
                   "min_p": (0.0, "0"), "repetition_penalty": (1.0, "1")}
        for name, (value, text) in neutral.items():
            if getattr(self, name) != value:
                raise ValueError(
                    f"{name} must be {text} with beam search (beam_width {k}), which is "
                    "deterministic and ranks by the model's own log-probabilities, got "
                    f"{getattr(self, name)!r}; set beam_width to 1 to sample")
        for name, value in (("seed", self.seed), ("constraint", self.constraint),
                            ("logprobs", self.logprobs)):
            if value is not None:
                raise ValueError(f"{name} is not supported with beam search (beam_width "
                                 f"{k}): leave it out, or set beam_width to 1")
        if self.stop:
            raise ValueError(f"stop is not supported with beam search (beam_width {k}): the "
                             "beams end at the end-of-sequence token or max_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def beam_search(self) -> bool:
        """Beam search is on (more than one beam)."""
        return self.beam_width > 1

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for the request: the beams, else one per sample."""
        return self.beam_width if self.beam_search else self.n


def _real(name: str, value: object, allowed: str, ok) -> float:
    """``value`` as a finite float satisfying ``ok``, else a ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or not ok(number):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return number


def _integer(name: str, value: object, low: int, high: int | None,
             allowed: str | None = None) -> int:
    """``value`` as an int in [low, high], else a ValueError naming the field and range."""
    if allowed is None:
        allowed = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    number = int(value)
    if number < low or (high is not None and number > high):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return number


def _stop_strings(stop: object) -> tuple[str, ...]:
    """The stop strings as a tuple of non-empty strings (one string is one stop string)."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple):
        raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must be a list of non-empty strings, got {s!r} in it")
    return tuple(stop)


def check_top_k(params: SamplingParams, vocab_size: int) -> None:
    """The part of SamplingParams that needs the model: ``top_k`` within its vocabulary."""
    if params.top_k > vocab_size:
        raise ValueError(
            f"top_k must be an integer in [0, {vocab_size}] for this model "
            f"(its vocabulary size), got {params.top_k}"
        )


def overlap_steps(config: EngineConfig, on_gpu: bool) -> bool:
    """Whether the engine overlaps its steps: the config's choice, else only on a GPU."""
    return on_gpu if config.overlap is None else config.overlap


def speculative_drafts(config: EngineConfig, overlap: bool) -> bool:
    """Whether decoding chats draft: the config's choice, else only where steps run
    synchronously (a drafting step is read before the next launches, so it costs an
    overlapping engine its overlap)."""
    return not overlap if config.speculative is None else config.speculative
