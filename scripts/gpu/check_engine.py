"""The engine checked end to end through its public API, on a model folder, on any backend.

Written for the lent H200 (``scripts/gpu/check.sh`` runs it there after the CUDA kernel
tests; docs/GPU.md): a change to ``engine/``, ``shaders/`` or the model adapter is done
only once this passed on the GPU. CI runs it on the CPU with ``--quick`` (tiny sizes), so
the checks themselves cannot rot.

What it checks, each against mlx-lm's own greedy generation on its own KV cache (an
independent reference; fp32 weights):

* prompts of 1, 255, 256, 257, 1k, 4k, 16k and 32k tokens, all submitted together (decodes
  and prefill chunks share steps), with prefill chunks of 16, 256 and 2048 tokens,
  overlapped and synchronous steps, on the kernel and on the reference attention path, and
  once with the app's own defaults (adaptive prefill budget);
* a prefix-cache hit (a prompt that extends a finished one reuses its blocks);
* n = 3 samples forked from one prompt (copy-on-write of the partial block);
* preemption in a pool too small for every reply at once;
* cancelling a request in the middle of a long prefill (its blocks come back);
* stop strings (the reply ends before the string);
* a width-4 beam search (n = 2): each reply's score is the model's own score of it, and the
  best equals the best of tests/reference.py's plain beam search on mlx-lm's cache;
* the app's repetition penalty on the device, overlapped, next to rows without it (greedy
  against mlx-lm's own ``make_logits_processors``);
* log-probabilities (the chosen token's and the top 5) against mlx-lm's log-softmax;
* a constrained reply (llguidance's mask applied on the device) against mlx-lm's greedy
  restricted by hand to the tokens a finite language allows, on a byte-level tokenizer;
* the 8-bit pool (``kv_precision="int8"``): every prompt length on every attention path ends
  without error, and the kernel's greedy tokens agree with the reference path's on the same
  8-bit pool (reported; the 8-bit kernels themselves are checked against a float64 oracle by
  tests/test_kv8_kernels.py in check.sh);
* no request anywhere ends with ``finish_reason`` error.

Greedy tokens must equal the reference's up to the first near-tie of the reference (top two
logits closer than ``TIE``): fp32 rounding differs between a batched paged step and one
sequence on a contiguous cache, and such a tie may flip (docs/GPU.md). A divergence
anywhere before a tie fails. The last line printed is the summary:
``gpu-check: PASS 123 checks ...`` or ``gpu-check: FAIL 3 of 123: ...``.

    python scripts/gpu/check_engine.py [--quick] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine import (  # noqa: E402
    Constraint,
    Engine,
    EngineConfig,
    FinalEvent,
    FinishReason,
    SamplingParams,
    TokenEvent,
)

#: Relative gap between the reference's two best logits under which a flipped greedy token
#: is rounding, not a bug (fp32 on a GPU: TF32 matmuls round at about 1e-3).
TIE = 2e-3
#: Log-probabilities: the engine's batched fp32 log-softmax against mlx-lm's (TF32 on a GPU).
LOGPROB_TOL = 2e-2


@dataclass(frozen=True)
class Sizes:
    """The check's dimensions: the full run for the GPU, a quick one for the CPU."""

    model: dict
    vocab: int
    context: int
    prompt_lengths: tuple[int, ...]
    chunks: tuple[int, ...]
    small_chunk_prompt_limit: int  # the smallest chunk runs only prompts up to this length
    new_tokens: int
    budget_mib: float
    aux_chunk: int  # the prefill chunk of the prefix/fork/stop/cancel checks
    cancel_prompt: int  # a prefill of hundreds of steps, cancelled halfway
    block_size: int = 16


FULL = Sizes(
    model=dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    vocab=4096, context=32768 + 64,
    prompt_lengths=(1, 255, 256, 257, 1000, 4000, 16000, 32000),
    chunks=(16, 256, 2048), small_chunk_prompt_limit=4000, new_tokens=8, budget_mib=512.0,
    aux_chunk=256, cancel_prompt=16000,
)
QUICK = Sizes(
    model=dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    vocab=512, context=4096 + 64,
    prompt_lengths=(1, 15, 16, 17, 40, 130),
    chunks=(16, 32), small_chunk_prompt_limit=130, new_tokens=4, budget_mib=24.0,
    aux_chunk=16, cancel_prompt=4000,
)


# ---- the model folder: an ordinary mlx-lm folder, loaded by the engine as a user's would be --


def write_model_folder(folder: Path, sizes: Sizes, seed: int = 0, byte_level: bool = False
                       ) -> Path:
    """A random-weight fp32 llama with a word-level tokenizer (one word per id), or with
    ``byte_level`` a byte-level BPE one (one byte per id, then the end-of-sequence token):
    the tokenizer kind llguidance can constrain."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = 257 if byte_level else sizes.vocab
    config = dict(model_type="llama", vocab_size=vocab, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=False,
                  max_position_embeddings=sizes.context, bos_token_id=0,
                  eos_token_id=vocab - 1, torch_dtype="float32", **sizes.model)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    if byte_level:
        chars = pre_tokenizers.ByteLevel.alphabet()
        byte_chars = sorted(chars, key=lambda c: _BYTE_OF[c])
        tok = Tokenizer(models.BPE({c: i for i, c in enumerate(byte_chars)} | {"<eos>": 256},
                                   merges=[]))
        tok.add_special_tokens(["<eos>"])
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        bos = eos = "<eos>"
    else:
        tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
        bos, eos = "w0", f"w{vocab - 1}"
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token=bos, eos_token=eos,
        unk_token=bos)))
    return folder


def _gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's byte-to-character table (a byte-level BPE's alphabet), character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _gpt2_byte_chars()


class Reference:
    """mlx-lm's own greedy generation (its KVCache, one sequence) with the logit gaps; and
    :meth:`decode`, the same with mlx-lm's repetition penalty, a hand-made allowed set and
    the log-softmax of every step."""

    def __init__(self, folder: Path) -> None:
        import mlx_lm

        self.model, self.tokenizer = mlx_lm.load(str(folder))
        self._memo: dict[tuple, tuple[list[int], list[float]]] = {}

    def greedy(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        key = (tuple(prompt), max_tokens)
        if key not in self._memo:
            from mlx_lm.models.cache import make_prompt_cache

            cache = make_prompt_cache(self.model)
            logits = None
            for start in range(0, len(prompt), 2048):
                logits = self.model(mx.array([prompt[start:start + 2048]]), cache=cache)[0, -1]
            tokens, gaps = [], []
            for _ in range(max_tokens):
                x = logits.astype(mx.float32)
                top2 = mx.topk(x, 2)
                token = int(mx.argmax(x).item())
                hi, lo = sorted((float(top2[0].item()), float(top2[1].item())), reverse=True)
                gaps.append((hi - lo) / (abs(hi) + 1.0))
                tokens.append(token)
                if token in self.tokenizer.eos_token_ids:
                    break
                logits = self.model(mx.array([[token]]), cache=cache)[0, -1]
            self._memo[key] = (tokens, gaps)
        return self._memo[key]

    def decode(self, prompt: list[int], max_tokens: int, penalty: float = 1.0,
               penalty_window: int = 128, allowed=None
               ) -> tuple[list[int], list[float], list[np.ndarray]]:
        """Greedy tokens, logit gaps and log-softmax rows (of the raw logits); with
        ``penalty`` through mlx-lm's ``make_logits_processors`` on prompt + reply, and with
        ``allowed(reply) -> set of ids`` the argmax restricted to that set."""
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.sample_utils import make_logits_processors

        processors = make_logits_processors(repetition_penalty=penalty,
                                            repetition_context_size=penalty_window) \
            if penalty != 1.0 else []
        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array([prompt]), cache=cache)[0, -1]
        tokens, gaps, logsoftmax = [], [], []
        for _ in range(max_tokens):
            raw = logits.astype(mx.float32)
            logsoftmax.append(np.array(raw - mx.logsumexp(raw)))
            x = raw[None]
            for processor in processors:
                x = processor(mx.array(prompt + tokens, dtype=mx.int32), x)
            x = np.array(x[0], dtype=np.float64)
            if allowed is not None:
                keep = np.full(x.shape, -np.inf)
                ids = sorted(allowed(tokens))
                keep[ids] = x[ids]
                x = keep
            order = np.argsort(-x)
            token = int(order[0])
            hi, lo = x[order[0]], x[order[1]]
            gaps.append(1.0 if not np.isfinite(lo) else (hi - lo) / (abs(hi) + 1.0))
            tokens.append(token)
            if token in self.tokenizer.eos_token_ids:
                break
            logits = self.model(mx.array([[token]]), cache=cache)[0, -1]
        return tokens, gaps, logsoftmax


# ---- results ---------------------------------------------------------------------------------


@dataclass
class Results:
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    tie_flips: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        (self.passed if ok else self.failed).append(name if ok else f"{name}: {detail}")
        if not ok:
            print(f"  FAIL {name}: {detail}", flush=True)
        return ok


def collect(handle) -> tuple[dict[int, list[int]], dict[int, FinalEvent]]:
    tokens: dict[int, list[int]] = {}
    finals: dict[int, FinalEvent] = {}
    for event in handle:
        if isinstance(event, TokenEvent):
            tokens.setdefault(event.index, []).extend(event.token_ids)
        else:
            finals[event.index] = event
    return tokens, finals


def compare_greedy(results: Results, name: str, got: list[int], expected: list[int],
                   gaps: list[float]) -> None:
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if first is None and len(got) != len(expected):
        first = min(len(got), len(expected))
    if first is None:
        results.check(name, True)
        return
    tie = min(gaps[: first + 1]) if gaps else 1.0
    if tie < TIE:
        results.tie_flips.append(f"{name} at token {first} (gap {tie:.1e})")
        results.check(name, True)
    else:
        results.check(name, False, f"token {first}: {got[first:first + 3]} vs "
                                   f"{expected[first:first + 3]} (smallest gap {tie:.1e})")


def ended_well(results: Results, name: str, finals: dict[int, FinalEvent], n: int = 1) -> bool:
    bad = [f for f in finals.values() if f.finish_reason == FinishReason.ERROR]
    if bad:
        return results.check(f"{name} no error", False, bad[0].error or "error")
    return results.check(f"{name} finals", len(finals) == n, f"{len(finals)} of {n} finals")


def start(folder: Path, sizes: Sizes, **overrides) -> Engine:
    config = dict(model=str(folder), kv_memory_mib=sizes.budget_mib, block_size=sizes.block_size,
                  max_batch=16, max_context=sizes.context,
                  speculative=True)  # on the GPU too (by default it drafts on the CPU only)
    config.update(overrides)
    eng = Engine(EngineConfig(**config))
    eng.start()
    if not eng.wait_ready(600):
        raise SystemExit(f"gpu-check: FAIL the engine did not load: {eng.load_error}")
    return eng


def prompt_of(length: int, vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab - 1, size=length).tolist()


# ---- the checks -----------------------------------------------------------------------------


def lengths_matrix(results: Results, folder: Path, ref: Reference, sizes: Sizes,
                   modes: list[str]) -> None:
    """Every prompt length, together in one engine, per chunk x overlap x attention path;
    then once with the app's defaults."""
    greedy = SamplingParams(temperature=0.0, max_tokens=sizes.new_tokens)
    prompts = {n: prompt_of(n, sizes.vocab, seed=n) for n in sizes.prompt_lengths}
    configs = [dict(attention=mode, overlap=overlap, prefill_chunk=chunk, prefill_target=0)
               for mode in modes for overlap in (True, False) for chunk in sizes.chunks]
    configs.append(dict())  # the app's defaults: chunk 256, adaptive budget, backend overlap
    for cfg in configs:
        tag = ",".join(f"{k}={v}" for k, v in cfg.items()) or "app-defaults"
        chunk = cfg.get("prefill_chunk", 256)
        lengths = [n for n in prompts
                   if chunk > min(sizes.chunks) or n <= sizes.small_chunk_prompt_limit]
        t0 = time.perf_counter()
        eng = start(folder, sizes, **cfg)
        try:
            handles = {n: eng.submit(prompt_tokens=prompts[n], params=greedy,
                                     session_id=f"len-{n}") for n in lengths}
            for n, handle in handles.items():
                tokens, finals = collect(handle)
                name = f"[{tag}] prompt {n}"
                if ended_well(results, name, finals):
                    compare_greedy(results, f"{name} greedy", tokens.get(0, []),
                                   *ref.greedy(prompts[n], sizes.new_tokens))
        finally:
            eng.stop()
        results.timings[tag] = time.perf_counter() - t0
        print(f"  {tag}: {len(lengths)} prompts in {results.timings[tag]:.1f} s", flush=True)


def prefix_cache(results: Results, eng: Engine, ref: Reference, sizes: Sizes) -> None:
    base = prompt_of(max(sizes.prompt_lengths[-3], 64), sizes.vocab, seed=11)
    longer = base + prompt_of(40, sizes.vocab, seed=12)
    greedy = SamplingParams(temperature=0.0, max_tokens=sizes.new_tokens)
    _, finals = collect(eng.submit(prompt_tokens=base, params=greedy, session_id="prefix-a"))
    ended_well(results, "prefix first", finals)
    hits_before = eng.snapshot().counters.prefix_cache_hits
    tokens, finals = collect(eng.submit(prompt_tokens=longer, params=greedy,
                                        session_id="prefix-b"))
    if ended_well(results, "prefix second", finals):
        cached = finals[0].usage.cached_prompt_tokens
        whole = len(base) // sizes.block_size * sizes.block_size
        results.check("prefix cache reused the first prompt's full blocks", cached >= whole - (
            sizes.block_size), f"{cached} cached tokens of {whole}")
        results.check("prefix cache hit counted",
                      eng.snapshot().counters.prefix_cache_hits > hits_before, "no hit")
        compare_greedy(results, "prefix second greedy", tokens.get(0, []),
                       *ref.greedy(longer, sizes.new_tokens))


def forks(results: Results, eng: Engine, ref: Reference, sizes: Sizes) -> None:
    prompt = prompt_of(3 * sizes.block_size + 5, sizes.vocab, seed=21)  # a partial last block
    tokens, finals = collect(eng.submit(
        prompt_tokens=prompt, params=SamplingParams(temperature=0.0, n=3,
                                                    max_tokens=sizes.new_tokens),
        session_id="forks"))
    if ended_well(results, "n=3 greedy", finals, n=3):
        expected = ref.greedy(prompt, sizes.new_tokens)
        for i in range(3):
            compare_greedy(results, f"n=3 greedy sample {i}", tokens.get(i, []), *expected)
    tokens, finals = collect(eng.submit(
        prompt_tokens=prompt, params=SamplingParams(temperature=1.0, n=3, seed=7,
                                                    max_tokens=2 * sizes.new_tokens),
        session_id="forks-sampled"))
    if ended_well(results, "n=3 sampled", finals, n=3):
        distinct = {tuple(tokens.get(i, [])) for i in range(3)}
        results.check("n=3 sampled samples differ (copy-on-write kept them apart)",
                      len(distinct) > 1, "three identical samples at temperature 1")


def stop_strings(results: Results, eng: Engine, ref: Reference, sizes: Sizes) -> None:
    prompt = prompt_of(2 * sizes.block_size + 3, sizes.vocab, seed=31)
    expected, _ = ref.greedy(prompt, sizes.new_tokens)
    words = [eng.decode([t]).strip() for t in expected]
    # A word that first appears after the reply's first token: the reply must end before it.
    at = next((i for i in range(max(1, len(words) // 2), len(words))
               if words[i] not in eng.decode(expected[:i])), None)
    if at is None:
        results.check("stop string: the reference reply has a word to stop at", False,
                      f"{words}")
        return
    stop, before = words[at], eng.decode(expected[:at])
    _, finals = collect(eng.submit(prompt_tokens=prompt, session_id="stop",
                                   params=SamplingParams(temperature=0.0, stop=[stop],
                                                         max_tokens=sizes.new_tokens)))
    if ended_well(results, "stop string", finals):
        final = finals[0]
        results.check("stop string ends the reply with stop", final.finish_reason ==
                      FinishReason.STOP, str(final.finish_reason))
        results.check("stop string is not in the reply and the text before it is",
                      stop not in final.text and final.text.strip() == before.strip(),
                      f"{final.text!r} (stop {stop!r})")


def penalty_and_logprobs(results: Results, eng: Engine, ref: Reference, sizes: Sizes) -> None:
    """The app's default penalty (1.15 over 128 tokens) on three greedy rows that overlap,
    next to a row without it; then the log-probabilities of a greedy reply."""
    new = 3 * sizes.new_tokens
    penalised = SamplingParams(temperature=0.0, max_tokens=new, repetition_penalty=1.15,
                               repetition_context_size=128)
    plain = SamplingParams(temperature=0.0, max_tokens=new)
    prompts = [prompt_of(n, sizes.vocab, seed=60 + n) for n in (5, 2 * sizes.block_size + 1,
                                                                 70, 9)]
    handles = [eng.submit(prompt_tokens=p, session_id=f"penalty-{i}",
                          params=plain if i == 3 else penalised) for i, p in enumerate(prompts)]
    changed = 0
    for i, handle in enumerate(handles):
        tokens, finals = collect(handle)
        name = f"repetition penalty row {i}" if i < 3 else "row without penalty next to them"
        if ended_well(results, name, finals):
            expected, gaps, _ = ref.decode(prompts[i], new, penalty=1.15 if i < 3 else 1.0)
            compare_greedy(results, f"{name} greedy", tokens.get(0, []), expected, gaps)
            changed += i < 3 and expected != ref.decode(prompts[i], new)[0]
    results.check("the penalty changes a reply (the check above can fail)", changed > 0,
                  "the three replies are the same with and without it")

    prompt = prompt_of(40, sizes.vocab, seed=70)
    events = [e for e in eng.submit(prompt_tokens=prompt, session_id="logprobs",
                                    params=SamplingParams(temperature=0.0, logprobs=5,
                                                          max_tokens=sizes.new_tokens))]
    finals = {e.index: e for e in events if isinstance(e, FinalEvent)}
    if not ended_well(results, "logprobs", finals):
        return
    got = [lp for e in events if isinstance(e, TokenEvent) for lp in (e.logprobs or ())]
    expected, _, rows = ref.decode(prompt, sizes.new_tokens)
    results.check("logprobs: one per reply token", len(got) == len([
        t for t in expected if t not in ref.tokenizer.eos_token_ids]),
        f"{len(got)} for {len(expected)} tokens")
    worst = 0.0
    for lp, row in zip(got, rows):
        kth = np.sort(row)[-5]
        worst = max(worst, abs(lp.logprob - row[lp.token_id]),
                    *(abs(v - row[t]) for t, v in lp.top),
                    *(kth - row[t] for t, _ in lp.top))
    results.check("logprobs equal mlx-lm's log-softmax (token and top 5)", worst < LOGPROB_TOL,
                  f"largest difference {worst:.2e}")


def constrained(results: Results, folder: Path, sizes: Sizes) -> None:
    """A regex of a finite language on a byte-level model: the greedy reply must be mlx-lm's
    greedy with every step restricted to the bytes that continue a word of the language
    (and the end once a word is complete); sampled siblings must each be a word of it."""
    words = ("yes", "no", "maybe")

    def allowed(reply: list[int]) -> set[int]:
        text = bytes(t for t in reply if t < 256).decode()
        ids = {w.encode()[len(text)] for w in words if w.startswith(text) and w != text}
        return ids | ({256} if text in words else set())

    ref = Reference(folder)
    eng = start(folder, sizes, prefill_chunk=sizes.aux_chunk, prefill_target=0)
    try:
        regex = Constraint(kind="regex", spec="|".join(words))
        for seed, length in ((80, 7), (81, 3 * sizes.block_size)):
            prompt = prompt_of(length, 256, seed)
            tokens, finals = collect(eng.submit(
                prompt_tokens=prompt, session_id=f"regex-{seed}",
                params=SamplingParams(temperature=0.0, max_tokens=8, constraint=regex)))
            name = f"constrained greedy ({length}-token prompt)"
            if ended_well(results, name, finals):
                expected, gaps, _ = ref.decode(prompt, 8, allowed=allowed)
                if expected[-1] == 256:  # a finished word: the engine ends the reply there
                    expected = expected[:-1]
                compare_greedy(results, name, tokens.get(0, []), expected, gaps)
                results.check(f"{name} is a word of the language", finals[0].text in words,
                              repr(finals[0].text))
        _, finals = collect(eng.submit(
            prompt_tokens=prompt_of(20, 256, 82), session_id="regex-sampled",
            params=SamplingParams(temperature=1.0, n=4, seed=3, max_tokens=8,
                                  constraint=regex)))
        if ended_well(results, "constrained n=4 sampled", finals, n=4):
            texts = [finals[i].text for i in range(4)]
            results.check("constrained n=4 sampled: each a word of the language",
                          all(t in words for t in texts), repr(texts))
    finally:
        eng.stop()


def int8_pool(results: Results, folder: Path, sizes: Sizes, modes: list[str]) -> None:
    """Every prompt length on an 8-bit pool, per attention path: no error, a full reply;
    the kernel's greedy tokens against the reference path's (same 8-bit pool) reported as
    the share of replies identical (8-bit rounding differs between the paths' reductions,
    so near-ties may flip: agreement is printed, not asserted)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=sizes.new_tokens)
    prompts = {n: prompt_of(n, sizes.vocab, seed=n) for n in sizes.prompt_lengths}
    replies: dict[str, dict[int, list[int]]] = {}
    for mode in modes:
        eng = start(folder, sizes, attention=mode, kv_precision="int8",
                    prefill_chunk=max(sizes.chunks), prefill_target=0)
        try:
            handles = {n: eng.submit(prompt_tokens=p, params=greedy, session_id=f"q8-{n}")
                       for n, p in prompts.items()}
            replies[mode] = {}
            for n, handle in handles.items():
                tokens, finals = collect(handle)
                if ended_well(results, f"[int8 {mode}] prompt {n}", finals):
                    replies[mode][n] = tokens.get(0, [])
                    results.check(f"[int8 {mode}] prompt {n} full reply",
                                  len(replies[mode][n]) >= 1, "no token")
        finally:
            eng.stop()
    if len(modes) > 1:
        a, b = (replies[m] for m in modes[:2])
        same = sum(a.get(n) == b.get(n) for n in prompts)
        print(f"  int8 pool: kernel and reference replies identical for {same} of "
              f"{len(prompts)} prompts", flush=True)
        results.timings["int8 kernel=reference replies"] = same / len(prompts)


def disk_tier(results: Results, folder: Path, ref: Reference, sizes: Sizes, mode: str,
              cache: Path) -> None:
    """The disk tier (docs/ARCHITECTURE.md §3.14) on this device: a prompt's blocks written
    by one engine (copied off the pool: gathers, an evaluated stack, a host copy) and read
    back into the pool by a fresh one (whole-block scatters), on a pool of the model's dtype
    and on an 8-bit one: the restarted engine's greedy reply equals the first's (and, at the
    model's dtype, mlx-lm's), and every full block came from disk."""
    prompt = prompt_of(max(sizes.prompt_lengths[-2], 3 * sizes.block_size + 1), sizes.vocab,
                       seed=61)
    greedy = SamplingParams(temperature=0.0, max_tokens=sizes.new_tokens)
    whole = (len(prompt) - 1) // sizes.block_size * sizes.block_size
    for precision in ("model", "int8"):
        name = f"[disk {mode} {precision}]"
        replies = []
        for run in ("first", "restart"):
            eng = start(folder, sizes, attention=mode, kv_precision=precision,
                        disk_cache_dir=str(cache / precision))
            try:
                tokens, finals = collect(eng.submit(prompt_tokens=prompt, params=greedy,
                                                    session_id=f"disk-{run}"))
            finally:
                eng.stop()
            if not ended_well(results, f"{name} {run}", finals):
                return
            replies.append(tokens.get(0, []))
        read = finals[0].usage.disk_prompt_tokens
        results.check(f"{name} every full block read back", read == whole,
                      f"{read} of {whole} prompt tokens from disk")
        results.check(f"{name} restart replies as the first run", replies[1] == replies[0],
                      f"{replies[1]} vs {replies[0]}")
        if precision == "model":
            compare_greedy(results, f"{name} restart greedy", replies[1],
                           *ref.greedy(prompt, sizes.new_tokens))


def beam_search(results: Results, eng: Engine, ref: Reference, sizes: Sizes) -> None:
    """A width-4 beam search (n = 2) against the plain one of tests/reference.py on mlx-lm's
    cache. A near-tie between two candidates may rank them the other way in a batched paged
    step, so the check is on the scores, not the tokens: each returned reply's score equals
    the reference model's own score of that reply (summed log-softmax / length ** penalty),
    and the best score equals the reference search's best, both within 1e-3 relative."""
    from tests.reference import reference_beam_search

    prompt = prompt_of(2 * sizes.block_size + 5, sizes.vocab, seed=41)  # a partial block
    params = SamplingParams(temperature=0.0, beam_width=4, n=2, max_tokens=sizes.new_tokens)
    tokens, finals = collect(eng.submit(prompt_tokens=prompt, params=params,
                                        session_id="beams"))
    if not ended_well(results, "beam search width 4", finals, n=2):
        return
    expected = reference_beam_search(prompt, params, ref.model, ref.tokenizer.eos_token_ids)
    for i in range(2):
        reply, score = tokens.get(i, []), finals[i].score
        logits = ref.model(mx.array([prompt + reply]))[0, len(prompt) - 1:-1].astype(mx.float32)
        logsoftmax = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        own = float(mx.take_along_axis(logsoftmax, mx.array(reply)[:, None], axis=-1).sum())
        own /= max(len(reply), 1) ** params.length_penalty
        results.check(f"beam search reply {i}: its score is the model's", score is not None
                      and abs(score - own) <= 1e-3 * max(1.0, abs(own)),
                      f"engine {score} vs the model's {own:.5f}")
    best = expected[0][1]
    results.check("beam search: the best score equals the reference search's",
                  finals[0].score is not None
                  and abs(finals[0].score - best) <= 1e-3 * max(1.0, abs(best)),
                  f"engine {finals[0].score} vs reference {best:.5f}")


def preemption(results: Results, folder: Path, ref: Reference, sizes: Sizes) -> None:
    bs = sizes.block_size
    replies = 4
    prompt_len, new = 6 * bs, 6 * bs
    per_seq_blocks = (prompt_len + new) // bs + 1
    num_blocks = per_seq_blocks * replies // 2 + 2  # room for about half the replies at once
    kv = 2 * sizes.model["num_hidden_layers"] * sizes.model["num_key_value_heads"] * \
        sizes.model["head_dim"] * 4 * bs
    eng = start(folder, sizes, kv_memory_mib=num_blocks * kv / 2**20, prefill_target=0,
                prefill_chunk=max(256, bs))
    try:
        prompts = [prompt_of(prompt_len, sizes.vocab, seed=40 + i) for i in range(replies)]
        params = SamplingParams(temperature=0.0, max_tokens=new)
        handles = [eng.submit(prompt_tokens=p, params=params, session_id=f"pre-{i}")
                   for i, p in enumerate(prompts)]
        for i, handle in enumerate(handles):
            tokens, finals = collect(handle)
            if ended_well(results, f"preemption reply {i}", finals):
                compare_greedy(results, f"preemption reply {i} greedy", tokens.get(0, []),
                               *ref.greedy(prompts[i], new))
        results.check("preemption happened in the small pool",
                      eng.snapshot().counters.preemptions > 0, "no preemption")
    finally:
        eng.stop()


def cancel_mid_prefill(results: Results, folder: Path, sizes: Sizes, mode: str) -> None:
    """Cancel a long prompt halfway through its prefill (16-token chunks: hundreds of steps).

    The halfway point is measured, not guessed: the same length is first prefilled whole
    (fresh prompts, so no prefix-cache hit; the fastest of two runs after a warm-up), then
    the request to cancel is cancelled after half that time. It must end cancelled, with
    nothing generated, and free its blocks."""
    eng = start(folder, sizes, attention=mode, prefill_chunk=min(sizes.chunks),
                prefill_target=0)
    try:
        one = SamplingParams(temperature=0.0, max_tokens=1)
        timings = []
        for seed in (48, 49, 50):  # the first also warms the engine up (compiles, caches)
            t0 = time.perf_counter()
            collect(eng.submit(prompt_tokens=prompt_of(sizes.cancel_prompt, sizes.vocab, seed),
                               params=one, session_id="prefill-timing"))
            timings.append(time.perf_counter() - t0)
        whole = min(timings[1:])
        handle = eng.submit(prompt_tokens=prompt_of(sizes.cancel_prompt, sizes.vocab, seed=51),
                            session_id="cancel-me", params=one)
        time.sleep(whole / 2)  # the workload: the user cancels halfway through the prefill
        handle.cancel()
        _, finals = collect(handle)
        final = finals.get(0)
        results.check(f"[{mode}] cancel mid-prefill ends the request cancelled",
                      final is not None and final.finish_reason == FinishReason.CANCELLED,
                      f"{final.finish_reason if final else 'no final'} after {whole / 2:.2f} s "
                      f"of a {whole:.2f} s prefill")
        results.check(f"[{mode}] cancel mid-prefill generated nothing",
                      final is not None and final.usage.generated_tokens == 0,
                      f"{final.usage.generated_tokens if final else '?'} tokens")
        # The next request runs, and the cancelled one's blocks are free again afterwards.
        _, after = collect(eng.submit(prompt_tokens=prompt_of(20, sizes.vocab, seed=52),
                                      params=SamplingParams(temperature=0.0, max_tokens=2),
                                      session_id="after-cancel"))
        ended_well(results, f"[{mode}] request after cancel", after)
        owners = {o for block in eng.snapshot().owners for o in block}
        results.check(f"[{mode}] cancelled request holds no block", "cancel-me" not in owners,
                      "its session still owns blocks")
    finally:
        eng.stop()


#: Tokens of the speculative case's replies (a finished reply is kept as a draft source only
#: from MIN_KEPT_REPLY tokens on).
SPECULATIVE_TOKENS = 64


def speculative(results: Results, eng: Engine, ref: Reference, sizes: Sizes) -> None:
    """Speculative decoding (ARCHITECTURE §3.13) is on in every engine of this check, so
    every greedy comparison above runs with whatever drafts the replies propose. Here a
    prompt that repeats itself is asked twice: the first reply must decode as the
    reference does (its drafts, if any, are chance on a random model); the second is the
    user's "regenerate", whose earlier reply is kept as its drafts and, greedy, is the same
    reply: its drafts must be accepted, so the step that keeps verified drafts and rolls
    the rest back runs on the device's kernels, and the reply must still equal the
    reference's."""
    half = prompt_of(sizes.block_size + 7, sizes.vocab, seed=31)
    prompt = half + half + half[:5]
    expected = ref.greedy(prompt, SPECULATIVE_TOKENS)
    greedy = SamplingParams(temperature=0.0, max_tokens=SPECULATIVE_TOKENS)
    for attempt in ("first", "regenerated"):
        accepted_before = eng.telemetry.accepted_draft_tokens
        tokens, finals = collect(eng.submit(prompt_tokens=prompt, params=greedy,
                                            session_id=f"speculative-{attempt}"))
        if not ended_well(results, f"speculative greedy ({attempt})", finals):
            return
        got = tokens.get(0, [])
        compare_greedy(results, f"speculative greedy ({attempt} reply)", got, *expected)
        # counted when the step that kept them was read, before its tokens were accepted
        accepted = eng.telemetry.accepted_draft_tokens - accepted_before
        print(f"  speculative, {attempt} reply: {accepted} drafts accepted of "
              f"{len(got)} tokens", flush=True)
    from engine.sched.speculation import MIN_KEPT_REPLY

    if len(got) >= MIN_KEPT_REPLY:  # shorter replies are not kept as draft sources
        results.check("speculative: a regenerated reply accepts its earlier reply's drafts",
                      accepted >= len(got) // 3, f"{accepted} accepted in {len(got)} tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CPU, CI)")
    parser.add_argument("--json", type=Path, help="write every check's outcome here")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    from engine.attention.dispatch import kernel_path

    modes = ["auto", "reference"] if kernel_path() else ["reference"]
    results = Results()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model_folder(Path(tmp) / "check-llama", sizes)
        ref = Reference(folder)
        print(f"gpu-check: {mx.default_device()}, mlx {mx.__version__}, attention paths "
              f"{modes} ({kernel_path() or 'reference only'})", flush=True)
        lengths_matrix(results, folder, ref, sizes, modes)
        for mode in modes:
            # overlapped, as every GPU engine is, so that the CPU's run (CI) takes the
            # device's path too: a speculator that waited for a probe never got one there
            eng = start(folder, sizes, attention=mode, prefill_chunk=sizes.aux_chunk,
                        prefill_target=0, overlap=True)
            try:
                prefix_cache(results, eng, ref, sizes)
                forks(results, eng, ref, sizes)
                stop_strings(results, eng, ref, sizes)
                penalty_and_logprobs(results, eng, ref, sizes)
                beam_search(results, eng, ref, sizes)
                speculative(results, eng, ref, sizes)
            finally:
                eng.stop()
            cancel_mid_prefill(results, folder, sizes, mode)
            disk_tier(results, folder, ref, sizes, mode, Path(tmp) / f"kv-{mode}")
        preemption(results, folder, ref, sizes)
        int8_pool(results, folder, sizes, modes)
        constrained(results, write_model_folder(Path(tmp) / "check-bytes", sizes,
                                                byte_level=True), sizes)
    elapsed = time.perf_counter() - t0
    total = len(results.passed) + len(results.failed)
    if args.json:
        args.json.write_text(json.dumps(dict(vars(results), elapsed_s=elapsed), indent=1))
    if results.tie_flips:
        print(f"  near-tie flips (allowed): {results.tie_flips}")
    where = f"{mx.default_device()}, {kernel_path() or 'reference'}, mlx {mx.__version__}"
    if results.failed:
        print(f"gpu-check: FAIL {len(results.failed)} of {total} checks ({where}, "
              f"{elapsed:.0f} s): " + "; ".join(results.failed[:6]))
        return 1
    print(f"gpu-check: PASS {total} checks, {len(results.tie_flips)} near-tie flips "
          f"({where}, {elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
