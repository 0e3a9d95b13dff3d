"""GPU bench (MLX's CUDA backend): the engine against mlx-lm's ``batch_generate`` at its best,
paged attention alone, and the long-paste scenario, in one run. Written for the lent H200
(``docs/GPU.md``); runs anywhere MLX runs (slowly on the CPU: ``--quick`` shrinks everything
for a smoke run, which CI does).

    python -m bench.gpu_bench [--quick] [--out bench/results/gpu.md] [--json raw.json]

* The baseline at its best: ``batch_generate`` with ``completion_batch_size`` and
  ``prefill_batch_size`` equal to n (its defaults, 32 and 8, would decode n = 64 as two
  batches of 32 and prefill in groups of 8), the engine's ``max_batch`` n as well.
* Two workloads each: greedy, and the app's default sampling for a new chat (temperature
  0.3, top-p 0.9, repetition penalty 1.15 over 128 tokens: ``APP_SAMPLING``, equal to
  ``app.core.generation_defaults.FALLBACK``, tested) given to mlx-lm as its own sampler and
  logits processors.
* Each n is repeated and interleaved (engine, batch_generate, engine, batch_generate, ...)
  after a warm-up of both; medians with min-max spread, and the ratio of each repeat pair.
* Models: random-weight llama models with Llama-3.2-1B and Llama-3.1-8B shapes in bf16
  (throughput depends on shapes, not weight values), a word-level tokenizer stand-in with the
  full vocabulary and no EOS, 128-token prompts given as ``prompt_tokens``, 128 new tokens,
  n = 1, 8, 32, 64 concurrent requests. NVRTC compiles one module per kernel instantiation,
  hence the warm-ups.
* Attention alone, all layers of a step: the paged kernel reading the pool through block
  tables, contiguous unmasked SDPA over the same tokens (the floor), and the gather path.
* Greedy agreement, fp32 weights: engine tokens == batch_generate tokens per sequence.
* Mixed-length workload: one ~2,500-token prompt and 7 short ones decoding together, against
  batch_generate (which pads every row to the longest prompt), and the engine's own parts
  run apart (the long prompt alone, then the short ones alone).
* Long paste: four chats streaming when an 8k-token prompt arrives, then a short question
  0.2 s later: the streaming chats' inter-token gaps before and during the paste, the short
  chat's first token and decode speed against the same scenario without the paste, and the
  paste's own time against alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

SHAPES = {
    "1B": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "8B": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}
VOCAB = 128256
BLOCK_SIZE = 16

#: The app's default sampling for a new chat (app/core/generation_defaults.py FALLBACK; the
#: app package needs Qt, which the GPU machine lacks, so the values are repeated here and a
#: test keeps them equal).
APP_SAMPLING = dict(temperature=0.3, top_p=0.9, min_p=0.0, top_k=0, repetition_penalty=1.15,
                    repetition_context_size=128)
WORKLOADS = ("greedy", "app-sampling")


@functools.cache
def make_tokenizer(vocab: int):
    """A real tokenizer (tokenizers WordLevel, one word per id) wrapped as mlx-lm wraps any:
    the engine and batch_generate detokenize through it. No EOS: every request runs to
    max_tokens on both sides.

    Byte-level, as the models users run are (SmolLM2, Llama 3, Qwen: a ``ByteLevel`` decoder,
    each word "Ġw<id>", a space and the word), with the streaming detokenizer mlx-lm's
    ``load`` gives such a tokenizer (``BPEStreamingDetokenizer``: constant work a token).
    The word-piece decoder this bench first used got mlx-lm's naive detokenizer, which
    decodes the whole reply again at every token (0.05 ms a token at 128 tokens, 0.19 at
    512, on the CI machine): the engine, which streams text, paid it on every row of every
    step and ``batch_generate``, which decodes once at the end, did not. On the CPU the
    engine's bookkeeping rose from 0.6 to 3.2 ms a step over one paste
    (bench/paste_host_phases.py); likely a part, not measured on the GPU, of why the
    budget's decode step rose from 5.0 to 7.9 ms during a paste on an H100 (session 23)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"\u0120w{i}": i for i in range(vocab)},
                                     unk_token="\u0120w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.ByteLevel()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok),
                            detokenizer_class=BPEStreamingDetokenizer)


def make_model(shape: dict, dtype: mx.Dtype, vocab: int = VOCAB, seed: int = 0):
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, max_position_embeddings=8192, **shape,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def loaded_model(model, tokenizer, name: str, dtype: mx.Dtype):
    from engine.models.folder import LoadedModel

    return LoadedModel(model=model, tokenizer=tokenizer, name=name, path=Path("."),
                       model_type="llama", max_context=8192, dtype=dtype)


PREFILL_CHUNK = 2048  # prompt tokens per engine step (the app's default is 256)


def start_engine(loaded, max_batch: int, kv_mib: float, attention_mode: str = "auto",
                 **config):
    """An Engine serving ``loaded`` (its loader is pointed at the in-memory model)."""
    import engine.loading as loading
    from engine import Engine, EngineConfig

    config.setdefault("prefill_chunk", PREFILL_CHUNK)
    eng = Engine(EngineConfig(kv_memory_mib=kv_mib, block_size=BLOCK_SIZE,
                              max_batch=max_batch, attention=attention_mode, **config))
    real_load = loading.load_model
    loading.load_model = lambda spec, quantized=None: loaded
    try:  # only for this engine's load: a process that loads other models later keeps its loader
        eng.start()
        if not eng.wait_ready():
            raise SystemExit(f"engine failed to load: {eng.load_error}")
    finally:
        loading.load_model = real_load
    return eng


class StepProfile:
    """Where an engine step's time goes, averaged over a run: the engine's own per-step phase
    times (engine.runner.telemetry.StepTimes: schedule, build = batch metadata + the model's lazy
    graph, forward = waiting for the device, sample, bookkeeping), read after every step by a
    wrapper on the step runner (removed by close()). ``step_ms``: each model step's wall time,
    in order (its median is a run's typical step, robust to a prefill step or a pause);
    ``phase_ms``: each phase's time for the same steps (``typical()`` gives their medians);
    ``decode_period_ms``: the engine's own period of each step that carried no prompt token
    (``StepRunner._observe``: the interval the streaming chats see between two tokens, each
    step paired with its own cost even when overlapped), so a run whose prefill steps are
    as many as its decode steps (64 prompts of 2,048 tokens) still has a decode median."""

    PARTS = ("schedule", "build", "forward", "sample", "bookkeeping")

    def __init__(self, eng) -> None:
        self.stepper = stepper = eng.runtime.stepper
        self.totals = dict.fromkeys(("step", *self.PARTS), 0.0)
        self.steps = 0
        self.step_ms: list[float] = []
        self.phase_ms: dict[str, list[float]] = {name: [] for name in self.PARTS}
        self.decode_period_ms: list[float] = []
        real_step = stepper.step
        self.prefill = prefill = stepper.prefill
        real_observe = prefill.observe

        def observe(step_s, decode_rows, prompt_tokens, prompt_context=0.0):
            real_observe(step_s, decode_rows, prompt_tokens, prompt_context)
            if prompt_tokens == 0 and decode_rows:
                self.decode_period_ms.append(step_s * 1e3)

        prefill.observe = observe

        def step():
            t0 = time.perf_counter()
            real_step()
            elapsed = time.perf_counter() - t0
            times = stepper._times
            if times.forward > 0:  # a step that ran the model
                self.steps += 1
                self.step_ms.append(elapsed * 1e3)
                self.totals["step"] += elapsed
                for name in self.PARTS:
                    self.totals[name] += getattr(times, name)
                    self.phase_ms[name].append(getattr(times, name) * 1e3)

        stepper.step = step

    def close(self) -> dict:
        del self.stepper.step, self.prefill.observe  # back to the classes' methods
        per = {k: v * 1e3 / max(self.steps, 1) for k, v in self.totals.items()}
        per["steps"] = self.steps
        return per

    def typical(self) -> dict:
        """The median step's wall time and each phase's median, in ms (the typical decode
        step of a run whose steps are mostly decode steps)."""
        med = {name: statistics.median(v) for name, v in self.phase_ms.items() if v}
        med["step"] = statistics.median(self.step_ms) if self.step_ms else 0.0
        med["decode period"] = (statistics.median(self.decode_period_ms)
                                if self.decode_period_ms else 0.0)
        return med


def engine_params(workload: str, max_tokens: int):
    from engine import SamplingParams

    if workload == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return SamplingParams(max_tokens=max_tokens, **APP_SAMPLING)


def engine_generate(eng, prompts: list[list[int]], max_tokens: int, workload: str = "greedy"):
    params = engine_params(workload, max_tokens)
    start = time.perf_counter()
    handles = [eng.submit(prompt_tokens=p, params=params, session_id=f"b-{i}")
               for i, p in enumerate(prompts)]
    for h in handles:
        h.result()
    elapsed = time.perf_counter() - start
    from engine.events import TokenEvent

    tokens = [[t for e in h if isinstance(e, TokenEvent) for t in e.token_ids] for h in handles]
    return elapsed, tokens


def mlx_sampling(workload: str) -> dict:
    """batch_generate's own sampler and logits processors for a workload (greedy: its
    default argmax sampler, no processors)."""
    if workload == "greedy":
        return {}
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    s = APP_SAMPLING
    return dict(sampler=make_sampler(temp=s["temperature"], top_p=s["top_p"], min_p=s["min_p"],
                                     top_k=s["top_k"]),
                logits_processors=make_logits_processors(
                    repetition_penalty=s["repetition_penalty"],
                    repetition_context_size=s["repetition_context_size"]))


def mlx_generate(loaded, prompts: list[list[int]], max_tokens: int, workload: str = "greedy"):
    """batch_generate at its best: one batch of all the prompts for prefill and decode."""
    from mlx_lm import batch_generate

    n = len(prompts)
    start = time.perf_counter()
    response = batch_generate(loaded.model, loaded.tokenizer, prompts, max_tokens=max_tokens,
                              return_token_ids=True, completion_batch_size=n,
                              prefill_batch_size=n, **mlx_sampling(workload))
    elapsed = time.perf_counter() - start
    return elapsed, [list(ids) for ids in response.token_ids]


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, size=length).tolist() for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Attention alone
# ---------------------------------------------------------------------------------------------


def time_fn(fn, repeats: int) -> float:
    """Median wall time (ms) of evaluating ``fn()``; synchronised, after two warm-ups."""
    for _ in range(2):
        mx.eval(fn())
        mx.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build_time(fn, repeats: int) -> float:
    """Median time (ms) of building ``fn()``'s graph alone (Python + MLX op construction)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
        mx.eval(out)
    mx.synchronize()
    return statistics.median(times)


def attention_case(shape: dict, batch: int, context: int, dtype: mx.Dtype, repeats: int,
                   layers: int | None = None) -> dict:
    """All layers' decode attention of one step: paged kernel / contiguous SDPA / gather."""
    from engine.attention.dispatch import paged_decode, reference_decode

    layers = layers or shape["num_hidden_layers"]
    h, kvh, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    nb = -(-context // BLOCK_SIZE)
    rng = np.random.default_rng(1)
    tables = mx.array(rng.permutation(batch * nb).reshape(batch, nb).astype(np.int32))
    lens = mx.array(np.full(batch, context, np.int32))
    scale = d**-0.5
    per_layer = []
    for _ in range(layers):
        k_pool = mx.random.normal((batch * nb, BLOCK_SIZE, kvh, d)).astype(dtype)
        v_pool = mx.random.normal((batch * nb, BLOCK_SIZE, kvh, d)).astype(dtype)
        k = mx.random.normal((batch, kvh, context, d)).astype(dtype)
        v = mx.random.normal((batch, kvh, context, d)).astype(dtype)
        q = mx.random.normal((batch, h, 1, d)).astype(dtype)
        per_layer.append((q, k_pool, v_pool, k, v))
    mx.eval(per_layer)

    def paged():
        return [paged_decode(q, kp, vp, tables, lens, scale, use_kernel=True)
                for q, kp, vp, _, _ in per_layer]

    def contiguous():
        return [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
                for q, _, _, k, v in per_layer]

    def gather():
        return [reference_decode(q, kp, vp, tables, lens, scale) for q, kp, vp, _, _ in per_layer]

    # Same numbers from the kernel and the reference (first layer).
    q, kp, vp, _, _ = per_layer[0]
    err = float(mx.max(mx.abs(
        paged_decode(q, kp, vp, tables, lens, scale, use_kernel=True).astype(mx.float32)
        - reference_decode(q, kp, vp, tables, lens, scale).astype(mx.float32))))
    kv_bytes = layers * batch * context * kvh * d * 2 * (2 if dtype != mx.float32 else 4)
    row = dict(batch=batch, context=context, layers=layers,
               paged_ms=time_fn(paged, repeats), sdpa_ms=time_fn(contiguous, repeats),
               gather_ms=time_fn(gather, repeats), max_abs_err=err, kv_bytes=kv_bytes)
    row["paged_build_ms"] = build_time(paged, repeats)
    row["sdpa_build_ms"] = build_time(contiguous, repeats)
    row["paged_over_sdpa"] = row["paged_ms"] / row["sdpa_ms"]
    row["paged_GBps"] = kv_bytes / row["paged_ms"] / 1e6
    return row


# ---------------------------------------------------------------------------------------------
# Engine vs batch_generate
# ---------------------------------------------------------------------------------------------


@dataclass
class ThroughputRow:
    shape: str
    n: int
    workload: str
    engine_tps: list[float]  # one per repeat, in run order
    mlx_tps: list[float]
    step_split: dict

    @property
    def ratios(self) -> list[float]:
        return [e / m for e, m in zip(self.engine_tps, self.mlx_tps)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.engine_tps) / statistics.median(self.mlx_tps)


def throughput(shape_name: str, ns: list[int], prompt_len: int, gen_tokens: int,
               vocab: int, shape: dict, kv_mib: float, repeats: int) -> list[ThroughputRow]:
    """Engine vs batch_generate at the same batch size n, each workload, interleaved."""
    tokenizer = make_tokenizer(vocab)
    model = make_model(shape, mx.bfloat16, vocab)
    loaded = loaded_model(model, tokenizer, f"random-{shape_name}", mx.bfloat16)
    rows = []
    for n in ns:
        eng = start_engine(loaded, max_batch=n, kv_mib=kv_mib)  # the same batch limit as mlx
        try:
            if n == ns[0]:
                print(f"[{shape_name}] attention path: {eng.model_info.attention}", flush=True)
            prompts = prompts_for(n, prompt_len, vocab, seed=n)
            for workload in WORKLOADS:
                engine_generate(eng, prompts, 8, workload)  # warm-up (kernel compiles)
                mlx_generate(loaded, prompts, 8, workload)
                e_tps, m_tps = [], []
                for _ in range(repeats):  # A B A B: drift hits both sides alike
                    e_time, e_tokens = engine_generate(eng, prompts, gen_tokens, workload)
                    m_time, m_tokens = mlx_generate(loaded, prompts, gen_tokens, workload)
                    e_tps.append(sum(map(len, e_tokens)) / e_time)
                    m_tps.append(sum(map(len, m_tokens)) / m_time)
                prof = StepProfile(eng)  # one more engine run, profiled (not timed)
                try:
                    engine_generate(eng, prompts, gen_tokens, workload)
                finally:
                    split = prof.close()
                row = ThroughputRow(shape_name, n, workload, e_tps, m_tps, split)
                rows.append(row)
                print(f"[{shape_name}] n={n} {workload}: engine {fmt_spread(e_tps)} tok/s, "
                      f"batch_generate(bs={n}) {fmt_spread(m_tps)} tok/s, ratio "
                      f"{row.ratio:.2f}x (pairs {', '.join(f'{r:.2f}' for r in row.ratios)}); "
                      f"step split (ms) { {k: round(v, 3) for k, v in split.items()} }",
                      flush=True)
        finally:
            eng.stop()
    del model, loaded
    mx.clear_cache()
    return rows


def kv8_throughput(shape_name: str, shape: dict, n: int, contexts: list[tuple[int, int]],
                   vocab: int, kv_mib: float, repeats: int) -> list[dict]:
    """The engine on a 16-bit pool against the same engine on an 8-bit pool (issue #26: "engine
    throughput at n = 64 not below the 16-bit engine's"), both with ``max_batch`` n and the
    same KV budget, each workload, interleaved (16, 8, 16, 8, ...); ``contexts``: (prompt
    tokens, new tokens) pairs (long prompts: decode reads the most K/V). Besides each run's
    tokens/s, its median step time (``StepProfile.step_ms``): the typical decode step, which a
    slow prefill step, a pause or the request's start and end do not move."""
    tokenizer = make_tokenizer(vocab)
    model = make_model(shape, mx.bfloat16, vocab)
    loaded = loaded_model(model, tokenizer, f"random-{shape_name}", mx.bfloat16)
    engines = {}
    rows = []
    try:
        for precision in ("model", "int8"):
            engines[precision] = start_engine(loaded, max_batch=n, kv_mib=kv_mib,
                                              kv_precision=precision)
        for prompt_len, gen_tokens in contexts:
            for w, workload in enumerate(WORKLOADS):
                tps: dict[str, list[float]] = {"model": [], "int8": []}
                step_ms: dict[str, list[float]] = {"model": [], "int8": []}
                phases: dict[str, list[dict]] = {"model": [], "int8": []}
                for eng in engines.values():  # warm-up (kernel compiles)
                    engine_generate(eng, prompts_for(n, prompt_len, vocab, seed=1 + w), 4,
                                    workload)
                for r in range(repeats):
                    for precision, eng in engines.items():
                        # fresh prompts per run and workload (each engine its own cache)
                        run_prompts = prompts_for(n, prompt_len, vocab,
                                                  seed=10_000 * (w + 1) + 100 * r + prompt_len)
                        prof = StepProfile(eng)
                        try:
                            elapsed, tokens = engine_generate(eng, run_prompts, gen_tokens,
                                                              workload)
                        finally:
                            prof.close()
                        tps[precision].append(sum(map(len, tokens)) / elapsed)
                        step_ms[precision].append(statistics.median(prof.step_ms))
                        phases[precision].append(prof.typical())
                row = dict(shape=shape_name, n=n, prompt=prompt_len, gen=gen_tokens,
                           workload=workload, tps16=tps["model"], tps8=tps["int8"],
                           ratio=statistics.median(tps["int8"]) / statistics.median(
                               tps["model"]),
                           step_ms16=step_ms["model"], step_ms8=step_ms["int8"],
                           step_ratio=statistics.median(step_ms["int8"]) / statistics.median(
                               step_ms["model"]),
                           phases16=median_phases(phases["model"]),
                           phases8=median_phases(phases["int8"]))
                rows.append(row)
                print(f"[kv8 {shape_name}] n={n} prompt={prompt_len} {workload}: 16-bit "
                      f"{fmt_spread(tps['model'])} tok/s, 8-bit {fmt_spread(tps['int8'])} "
                      f"tok/s, ratio {row['ratio']:.2f}x; median step 16-bit "
                      f"{fmt_spread(step_ms['model'])} ms, 8-bit {fmt_spread(step_ms['int8'])} "
                      f"ms, 8 / 16 {row['step_ratio']:.2f}x; median phases (ms) 16-bit "
                      f"{row['phases16']}, 8-bit {row['phases8']}", flush=True)
    finally:
        for eng in engines.values():
            eng.stop()
        del model, loaded
        mx.clear_cache()
    return rows


def median_phases(runs: list[dict]) -> dict:
    """Each phase's median over runs of ``StepProfile.typical()``, rounded (ms)."""
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]} if runs else {}


def fmt_spread(values: list[float]) -> str:
    """Median (min-max)."""
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def agreement(shape: dict, n: int, prompt_len: int, gen_tokens: int, vocab: int,
              kv_mib: float) -> tuple[int, int, str, dict]:
    """fp32 greedy tokens, engine (kernel path) vs batch_generate: sequences equal / n; also
    the engine on its reference attention path, to tell kernel error from backend rounding
    (sequences equal per pair, and where the first differing token of each pair falls)."""
    tokenizer = make_tokenizer(vocab)
    model = make_model(shape, mx.float32, vocab, seed=3)
    loaded = loaded_model(model, tokenizer, "random-fp32", mx.float32)
    prompts = prompts_for(n, prompt_len, vocab, seed=99)
    runs = {}
    path = "?"
    for mode in ("auto", "reference"):
        eng = start_engine(loaded, max_batch=n, kv_mib=kv_mib, attention_mode=mode)
        if mode == "auto":
            path = eng.model_info.attention
        try:
            _, runs[mode] = engine_generate(eng, prompts, gen_tokens)
        finally:
            eng.stop()
    _, runs["mlx"] = mlx_generate(loaded, prompts, gen_tokens)
    del model, loaded
    mx.clear_cache()

    def compare(a, b):
        firsts = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None)
                  for s, t in zip(runs[a], runs[b])]
        return dict(equal=sum(f is None for f in firsts),
                    first_diff=[f for f in firsts if f is not None])

    pairs = {"kernel-mlx": compare("auto", "mlx"), "reference-mlx": compare("reference", "mlx"),
             "kernel-reference": compare("auto", "reference")}
    return pairs["kernel-mlx"]["equal"], n, path, pairs


def mixed(shape: dict, long_len: int, short_len: int, shorts: int, gen_tokens: int,
          vocab: int, kv_mib: float) -> dict:
    tokenizer = make_tokenizer(vocab)
    model = make_model(shape, mx.bfloat16, vocab)
    loaded = loaded_model(model, tokenizer, "random-mixed", mx.bfloat16)
    long_prompt = prompts_for(1, long_len, vocab, seed=7)
    short_prompts = prompts_for(shorts, short_len, vocab, seed=8)
    prompts = long_prompt + short_prompts
    eng = start_engine(loaded, max_batch=len(prompts), kv_mib=kv_mib)
    try:
        engine_generate(eng, prompts_for(len(prompts), 64, vocab, seed=5), 4)  # warm-up
        engine_generate(eng, prompts_for(1, long_len, vocab, seed=6), 4)
        e_all, e_tokens = engine_generate(eng, prompts, gen_tokens)
        e_long, _ = engine_generate(eng, prompts_for(1, long_len, vocab, seed=9), gen_tokens)
        e_short, _ = engine_generate(eng, prompts_for(shorts, short_len, vocab, seed=10),
                                     gen_tokens)
    finally:
        eng.stop()
    mlx_generate(loaded, prompts_for(2, 64, vocab, seed=5), 4)  # warm-up
    m_all, m_tokens = mlx_generate(loaded, prompts, gen_tokens)
    del model, loaded
    mx.clear_cache()
    generated = sum(map(len, e_tokens))
    return dict(engine_s=e_all, mlx_s=m_all, ratio=m_all / e_all, parts_s=e_long + e_short,
                within=e_all / (e_long + e_short), engine_tps=generated / e_all,
                mlx_tps=sum(map(len, m_tokens)) / m_all, long_len=long_len,
                short_len=short_len, shorts=shorts)


class Timeline:
    """When each token event of a handle arrived (a thread per handle)."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.times: list[float] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        from engine.events import TokenEvent

        for event in self.handle:
            if isinstance(event, TokenEvent):
                self.times.append(time.perf_counter())

    def gaps_ms(self, start: float, end: float) -> list[float]:
        inside = [t for t in self.times if start <= t <= end]
        return [1e3 * (b - a) for a, b in zip(inside, inside[1:])]

    def wait_tokens(self, count: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < count and time.monotonic() < deadline and not self.handle.done:
            time.sleep(0.005)  # a bench waiting for a workload state, not a test's sync


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class BudgetTrace:
    """What the prefill budget decided and learned, step by step, while installed (a profile
    for the paste scenario): each ``budget()`` call's answer and whether the prompt under way
    skipped the step, each observed step's time, rows, prompt tokens, and the cost line and
    decode time the budget held after it. Wraps the engine's PrefillBudget methods (the
    engine thread calls them); ``close()`` restores them."""

    def __init__(self, eng) -> None:
        self.prefill = prefill = eng.runtime.stepper.prefill
        self.events: list[tuple] = []
        real_budget, real_observe = prefill.budget, prefill.observe

        def budget(decoding, context=0):
            tokens = real_budget(decoding, context)
            self.events.append(("budget", time.perf_counter(), tokens, int(prefill.holding),
                                context, prefill.free_tokens))
            return tokens

        def observe(step_s, decode_rows, prompt_tokens, prompt_context=0.0):
            real_observe(step_s, decode_rows, prompt_tokens, prompt_context)
            a, b = prefill.cost.line() if prefill.cost.ready else (0.0, 0.0)
            self.events.append(("step", time.perf_counter(), step_s, decode_rows, prompt_tokens,
                                prompt_context, a, b, prefill.decode_s or 0.0))

        prefill.budget, prefill.observe = budget, observe

    def close(self) -> list[tuple]:
        del self.prefill.budget, self.prefill.observe  # back to the class's methods
        return self.events


def paste_scenario(eng, prompts, repeats: int, short_tokens: int,
                   app_priorities: bool = True, fresh_budget: bool = False,
                   fresh_sessions: bool = False) -> dict:
    """Chats streaming when a long paste arrives, then a short question 0.2 s later, on
    ``eng``; the same scenario without the paste is the short chat's "alone"; the paste alone
    runs on the idle engine. ``prompts(kind, index)`` gives fresh prompts ("stream", "paste",
    "short", "alone"), so that no run reads another's blocks from the prefix cache.

    ``app_priorities`` gives the requests the priorities the app gives them
    (app/bridges/engine_bridge.py ``set_focus``): the streaming chats sit in unfocused panes
    (BACKGROUND), the paste is sent in the focused pane (INTERACTIVE), and the short question
    is typed in another pane, which takes the focus (it goes INTERACTIVE, the paste's chat
    BACKGROUND). Without, every request is NORMAL (an API client that says nothing).

    Two switches for the first repeat's slowness (bench/results/gpu.md, session 25), each a
    suspect state: ``fresh_budget`` gives the prefill budget its initial state before each
    run (the engine is idle then: the previous run's requests have all finished), and
    ``fresh_sessions`` gives every run session ids of its own."""
    from engine import Priority

    focus, aside = ((Priority.INTERACTIVE, Priority.BACKGROUND) if app_priorities
                    else (Priority.NORMAL, Priority.NORMAL))
    runs: dict[str, list] = {"with": [], "without": [], "paste_alone_s": []}
    streams = prompts("streams", 0)
    for r in range(repeats):
        for with_paste in (True, False):
            run = 2 * r + int(with_paste)
            tag = f"-{run}" if fresh_sessions else ""
            if fresh_budget:
                budget = eng.runtime.stepper.prefill
                budget.__init__(budget.max_chunk, budget.min_chunk, budget.target, budget.floor)
            stream_handles = [
                eng.submit(prompt_tokens=p, params=engine_params("app-sampling", 100000),
                           session_id=f"stream-{i}{tag}", priority=aside)
                for i, p in enumerate(prompts("streams", run))]
            lines = [Timeline(h) for h in stream_handles]
            for line in lines:
                line.wait_tokens(24)
            t_before = max(line.times[4] for line in lines)
            t_paste = time.perf_counter()
            paste_line = None
            trace = BudgetTrace(eng) if with_paste else None
            if with_paste:
                paste_line = Timeline(eng.submit(
                    prompt_tokens=prompts("paste", run), params=engine_params("app-sampling", 4),
                    session_id=f"paste{tag}", priority=focus))
            time.sleep(0.2)  # the user types a short question while the paste is read
            t_short = time.perf_counter()
            if with_paste:  # the short question's pane takes the focus
                eng.set_priority(f"paste{tag}", aside)
            short_line = Timeline(eng.submit(
                prompt_tokens=prompts("short", run), params=engine_params("greedy", short_tokens),
                session_id=f"short{tag}", priority=focus))
            short_line.thread.join()
            if paste_line is not None:
                paste_line.thread.join()
            t_end = paste_line.times[0] if paste_line else short_line.times[-1]
            if trace is not None:  # times relative to the paste's arrival
                events = [(e[0], e[1] - t_paste, *e[2:]) for e in trace.close()]
                runs.setdefault("traces", []).append(events)
                if r == 0:
                    runs["trace"] = events  # the first repeat's, as the analyses read it
            for h in stream_handles:
                h.cancel()
            for line in lines:
                line.thread.join()
            before = [g for line in lines for g in line.gaps_ms(t_before, t_paste)]
            during = [g for line in lines for g in line.gaps_ms(t_paste, t_end)]
            st = short_line.times
            runs["with" if with_paste else "without"].append(dict(
                before_p50=percentile(before, 50), before_p99=percentile(before, 99),
                during_p50=percentile(during, 50), during_p99=percentile(during, 99),
                during_max=max(during) if during else float("nan"),
                short_ttft_ms=1e3 * (st[0] - t_short),
                short_decode_tps=(len(st) - 1) / (st[-1] - st[0]) if len(st) > 1 else 0.0,
                paste_s=(paste_line.times[0] - t_paste) if paste_line else None))
        t0 = time.perf_counter()  # the paste alone, on an idle engine
        eng.submit(prompt_tokens=prompts("alone", r), params=engine_params("app-sampling", 1),
                   session_id="alone").result()
        runs["paste_alone_s"].append(time.perf_counter() - t0)
    return dict(runs=runs, streams=len(streams), paste_len=len(prompts("paste", 0)),
                short_len=len(prompts("short", 0)), short_tokens=short_tokens,
                priorities="app" if app_priorities else "none (all NORMAL)")


def paste(shape: dict, streams: int, stream_prompt: int, paste_len: int, short_len: int,
          short_tokens: int, vocab: int, kv_mib: float, repeats: int,
          prefill_target: float | None = None, warm_scenario: bool = False,
          fresh_budget: bool = False, fresh_sessions: bool = False) -> dict:
    """The long-paste scenario on a random-weight model, with the app's engine defaults
    (256-token chunks, adaptive prefill budget); ``prefill_target``: another step target
    than the engine's (``--prefill-target``, the trade bench/results/paste.md measured on
    the CPU in session 22); ``warm_scenario``: run the scenario once unrecorded first
    (``--paste-warmup``). The warm-up otherwise covers a stream batch and the paste alone,
    not the paste's chunks beside decodes: on an H100 every run's first repeat was the
    slower on the paste (2.9-4.3x its time alone against 1.5-2.8x in the second, 8 runs of
    8, session 24), cause not yet separated (those steps' first use, or the trace, which
    was then recorded in the first repeat only; each repeat's is recorded now)."""
    tokenizer = make_tokenizer(vocab)
    model = make_model(shape, mx.bfloat16, vocab)
    loaded = loaded_model(model, tokenizer, "random-paste", mx.bfloat16)
    target = {} if prefill_target is None else {"prefill_target": prefill_target}
    loading_started = time.perf_counter()
    eng = start_engine(loaded, max_batch=streams + 2, kv_mib=kv_mib, prefill_chunk=256,
                       **target)
    load_s = time.perf_counter() - loading_started  # with the gathered prefill's warm-up
    sizes = {"streams": (streams, stream_prompt), "paste": (1, paste_len),
             "short": (1, short_len), "alone": (1, paste_len)}

    def prompts(kind: str, run: int):
        count, length = sizes[kind]
        made = prompts_for(count, length, vocab, seed=1000 * (1 + list(sizes).index(kind)) + run)
        return made if kind == "streams" else made[0]

    try:
        engine_generate(eng, prompts_for(streams, stream_prompt, vocab, seed=60), 8,
                        "app-sampling")  # warm-up
        engine_generate(eng, prompts_for(1, paste_len, vocab, seed=59), 2, "app-sampling")
        if warm_scenario:  # the whole scenario once, unrecorded, on prompts of its own
            paste_scenario(eng, lambda kind, run: prompts(kind, run + 500), 1, short_tokens)
        result = paste_scenario(eng, prompts, repeats, short_tokens,
                                fresh_budget=fresh_budget, fresh_sessions=fresh_sessions)
        result["warm_scenario"] = warm_scenario
        result["fresh_budget"], result["fresh_sessions"] = fresh_budget, fresh_sessions
        result["prefill_target"] = eng.config.prefill_target
        result["engine_load_s"] = load_s
        return result
    finally:
        eng.stop()
        del model, loaded
        mx.clear_cache()


# ---------------------------------------------------------------------------------------------


#: The interactive-first issue's targets for the long paste: a streaming chat's gap p99
#: during the paste over its p50 before, a short chat's first token during the paste over
#: without it, its decode speed (at least), the paste's time over alone.
GPU_PASTE_TARGETS = dict(gap=2.5, ttft=2.0, decode=0.5, paste=1.5)
CPU_PASTE_TARGETS = dict(gap=2.5, ttft=3.0, decode=0.5, paste=2.5)


def paste_report(p: dict, targets: dict) -> list[str]:
    """Markdown rows of one paste_scenario result against ``targets``."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    w, wo = p["runs"]["with"], p["runs"]["without"]

    def med(rows, key):
        return statistics.median(x[key] for x in rows)

    def spread(rows, key, fmt="{:.1f}"):
        values = [x[key] for x in rows]
        return (fmt.format(statistics.median(values)) + " (" + fmt.format(min(values))
                + "-" + fmt.format(max(values)) + ")")

    before_p50 = med(w, "before_p50")
    ttft = med(w, "short_ttft_ms") / med(wo, "short_ttft_ms")
    decode = med(w, "short_decode_tps") / med(wo, "short_decode_tps")
    paste_ratio = med(w, "paste_s") / statistics.median(p["runs"]["paste_alone_s"])
    gap = med(w, "during_p99") / before_p50
    lines = [f"{p['streams']} chats streaming (app sampling) when a {p['paste_len']}-token "
             f"paste arrives; a {p['short_len']}-token question 0.2 s later "
              f"({p['short_tokens']} greedy tokens); priorities: "
              f"{p.get('priorities', 'none (all NORMAL)')}. Median (min-max) over repeats.", "",
              "| measure | value | target (interactive-first issue) | verdict |",
              "| --- | --- | --- | --- |",
              f"| streaming gaps before the paste, p50 / p99 ms | "
              f"{spread(w, 'before_p50')} / {spread(w, 'before_p99')} | | |",
              f"| streaming gaps during the paste, p50 / p99 / max ms | "
              f"{spread(w, 'during_p50')} / {spread(w, 'during_p99')} / "
              f"{spread(w, 'during_max')} | p99 <= {targets['gap']}x p50 before ({gap:.2f}x) | "
              f"{verdict(gap <= targets['gap'])} |",
              f"| short chat's first token, ms: during the paste / without it | "
              f"{spread(w, 'short_ttft_ms')} / {spread(wo, 'short_ttft_ms')} | "
              f"<= {targets['ttft']}x "
              f"({ttft:.2f}x) | {verdict(ttft <= targets['ttft'])} |",
              f"| short chat's decode, tok/s: during / without | "
              f"{spread(w, 'short_decode_tps')} / {spread(wo, 'short_decode_tps')} | "
              f">= {targets['decode']}x ({decode:.2f}x) | "
              f"{verdict(decode >= targets['decode'])} |",
              f"| the paste's time to first token, s: among the chats / alone | "
              f"{spread(w, 'paste_s', '{:.2f}')} / "
              f"{statistics.median(p['runs']['paste_alone_s']):.2f} | "
              f"<= {targets['paste']}x "
              f"({paste_ratio:.2f}x) | {verdict(paste_ratio <= targets['paste'])} |"]
    if "engine_load_s" in p:
        lines.append(f"| the engine's load, s (building the gathered prefill's attention "
                     f"shapes when it is on) | {p['engine_load_s']:.2f} | | |")
    return lines


def report(results: dict) -> str:
    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    lines = [f"Device: {results['device']}; attention path: {results['path']}; "
             f"{results['note']}", ""]
    lines += ["## Engine vs mlx-lm batch_generate at the same batch size (aggregate generated "
              "tokens/s, bf16)", "",
              f"batch_generate with completion_batch_size = prefill_batch_size = n, the engine "
              f"with max_batch = n; {results['repeats']} interleaved repeats each (engine, "
              f"batch_generate, ...), median (min-max); ratio = median / median, then each "
              f"repeat pair's ratio. Targets are the engine-speed issue's (>= 1.1x at n = 1, "
              f">= 1.5x from n = 8).", "",
              "| shape | n | workload | engine | batch_generate | ratio | per pair | target | "
              "verdict |",
              "| --- | ---: | --- | ---: | ---: | ---: | --- | --- | --- |"]
    for r in results["throughput"]:
        target = 1.1 if r["n"] == 1 else 1.5
        ratios = [e / m for e, m in zip(r["engine_tps"], r["mlx_tps"])]
        lines.append(f"| {r['shape']} | {r['n']} | {r['workload']} | "
                     f"{fmt_spread(r['engine_tps'])} | {fmt_spread(r['mlx_tps'])} | "
                     f"{r['ratio']:.2f}x | {', '.join(f'{x:.2f}' for x in ratios)} | "
                     f">= {target}x | {verdict(min(ratios) >= target)} |")
    lines += ["", "Engine step split (a profiled extra run, mean ms per step from the engine's "
              "own phase times: build = batch metadata + model graph, forward = waiting for "
              "the device), and the median wall time per generated-token step of both:",
              "", "| shape | n | workload | step | schedule | build | forward | sample | "
              "bookkeeping | engine wall per step | batch_generate wall per step |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results["throughput"]:
        sp = r["step_split"]
        mlx_step = 1e3 * r["n"] / statistics.median(r["mlx_tps"])
        engine_step = 1e3 * r["n"] / statistics.median(r["engine_tps"])
        lines.append(f"| {r['shape']} | {r['n']} | {r['workload']} | {sp['step']:.2f} | "
                     f"{sp['schedule']:.2f} | {sp['build']:.2f} | {sp['forward']:.2f} | "
                     f"{sp['sample']:.2f} | {sp['bookkeeping']:.2f} | {engine_step:.2f} | "
                     f"{mlx_step:.2f} |")
    if results["attention"]:
        lines += ["", "## Decode attention alone, all layers of one step (median ms)", "",
                  "| shape | n | context | paged kernel | contiguous SDPA | gather path | "
                  "paged / SDPA | graph build paged / SDPA | K/V GB/s (paged) | max abs err | "
                  "target | verdict |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- "
                  "| --- |"]
        for r in results["attention"]:
            lines.append(
                f"| {r['shape']} | {r['batch']} | {r['context']} | {r['paged_ms']:.3f} | "
                f"{r['sdpa_ms']:.3f} | {r['gather_ms']:.3f} | {r['paged_over_sdpa']:.2f}x | "
                f"{r.get('paged_build_ms', float('nan')):.3f} / "
                f"{r.get('sdpa_build_ms', float('nan')):.3f} | {r['paged_GBps']:.0f} | "
                f"{r['max_abs_err']:.2g} | <= 1.2x | "
                f"{verdict(r['paged_over_sdpa'] <= 1.2)} |")
    eq, n, path, pairs = results["agreement"]
    if n:
        lines += ["", f"Greedy agreement, fp32 weights, {n} sequences x "
                  f"{results.get('agree_tokens', '?')} tokens: {eq}/{n} equal token for token "
                  f"(engine path {path} vs batch_generate). Per pair (equal sequences; first "
                  f"differing token index of the others): "
                  + "; ".join(f"{k} {v['equal']}/{n} {v['first_diff']}"
                              for k, v in pairs.items()) + "."]
    m = results["mixed"]
    if m:
        lines += ["", "## Mixed-length workload (bf16, 1B shape, greedy)", "",
                  f"One {m['long_len']}-token prompt + {m['shorts']} x {m['short_len']}-token "
                  f"prompts, {results['gen_tokens']} tokens each; batch_generate with batch "
                  f"sizes {m['shorts'] + 1}.", "",
                  "| | engine | batch_generate | ratio |",
                  "| --- | ---: | ---: | ---: |",
                  f"| wall time | {m['engine_s']:.2f} s | {m['mlx_s']:.2f} s | "
                  f"{m['ratio']:.2f}x |",
                  f"| vs its parts run apart | {m['engine_s']:.2f} s | {m['parts_s']:.2f} s "
                  f"(parts) | {m['within']:.2f}x |"]
    if results.get("kv8"):
        lines += ["", "## Engine throughput, 8-bit pool against 16-bit (issue #26)", "",
                  "The same engine (max_batch = n, the same KV budget) on a bf16 pool and on an "
                  "int8 pool with per-token scales; interleaved repeats, aggregate generated "
                  "tokens/s, median (min-max); and each run's median step time (ms), the "
                  "typical decode step. Target: the 8-bit engine not below the 16-bit "
                  "one at n = 64.", "",
                  "| shape | n | prompt + new tokens | workload | 16-bit | 8-bit | 8 / 16 | "
                  "per pair | median step 16 / 8 (ms) | step 8 / 16 | verdict |",
                  "| --- | ---: | --- | --- | ---: | ---: | ---: | --- | --- | ---: | --- |"]
        for r in results["kv8"]:
            pairs = [e / m for e, m in zip(r["tps8"], r["tps16"])]
            lines.append(f"| {r['shape']} | {r['n']} | {r['prompt']} + {r['gen']} | "
                         f"{r['workload']} | {fmt_spread(r['tps16'])} | "
                         f"{fmt_spread(r['tps8'])} | {r['ratio']:.2f}x | "
                         f"{', '.join(f'{x:.2f}' for x in pairs)} | "
                         f"{fmt_spread(r['step_ms16'])} / {fmt_spread(r['step_ms8'])} | "
                         f"{r['step_ratio']:.2f}x | {verdict(r['ratio'] >= 1.0)} |")
        parts = ("decode period", "step", *StepProfile.PARTS)
        lines += ["", "Each run's median decode period (the engine's own interval between two "
                  "tokens, over the steps that carried no prompt token: valid when prefill "
                  "steps are many), median step and median phase times over all model steps "
                  "(engine.runner.telemetry: build = batch metadata + the model's lazy graph, "
                  "forward = waiting for the device), the median over runs, ms, "
                  "16-bit / 8-bit:", "",
                  "| shape | prompt + new tokens | workload | "
                  + " | ".join(parts) + " |",
                  "| --- | --- | --- | " + " | ".join("---:" for _ in parts) + " |"]
        for r in results["kv8"]:
            p16, p8 = r.get("phases16", {}), r.get("phases8", {})
            cells = [f"{p16.get(k, 0):.2f} / {p8.get(k, 0):.2f}" for k in parts]
            lines.append(f"| {r['shape']} | {r['prompt']} + {r['gen']} | {r['workload']} | "
                         + " | ".join(cells) + " |")
    p = results.get("paste")
    if p:
        from engine import EngineConfig

        target = p.get("prefill_target")
        budget = ("adaptive prefill budget" if target in (None, EngineConfig().prefill_target)
                  else f"adaptive prefill budget at a step target of {target} (not the default)")
        lines += ["", f"## Long paste (bf16, 1B shape, the app's engine defaults: 256-token "
                  f"chunks, {budget}; {len(p['runs']['with'])} repeats with and "
                  f"without the paste, interleaved)", ""]
        lines += paste_report(p, GPU_PASTE_TARGETS)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="PagedChat GPU bench")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="markdown report path")
    parser.add_argument("--json", type=Path, default=None, help="raw numbers path")
    parser.add_argument("--parts", default="attention,throughput,agreement,mixed,paste",
                        help="comma-separated; also kv8 (8-bit pool against 16-bit)")
    parser.add_argument("--shapes", default="1B,8B", help="throughput shapes")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prefill-target", type=float, default=None, metavar="X",
                        help="the paste part's EngineConfig.prefill_target (default: the "
                             "engine's)")
    parser.add_argument("--kv8-contexts", default="128:128,2048:64",
                        help="the kv8 part's prompt:new-token pairs, comma-separated")
    parser.add_argument("--kv-write", choices=("store", "scatter"), default="store",
                        help="how the engine writes K/V on CUDA's kernel path: one in-place "
                             "launch a layer (the engine's) or MLX's scatters (before it)")
    parser.add_argument("--budget-probe", choices=("on", "off"), default="on",
                        help="the prefill budget's probe past its knee (the engine's) or not "
                             "(before it)")
    parser.add_argument("--paste-warmup", action="store_true",
                        help="run the paste scenario once unrecorded before measuring it")
    parser.add_argument("--yield-free", choices=("on", "off"), default="on",
                        help="a yielding paste takes the step's free tokens where they are "
                             "more than its share (the engine's) or only the share (before)")
    parser.add_argument("--fresh-budget", action="store_true",
                        help="the paste part: the prefill budget's initial state before each "
                             "run (a suspect of the first repeat's slowness)")
    parser.add_argument("--fresh-sessions", action="store_true",
                        help="the paste part: session ids of its own for every run")
    parser.add_argument("--gathered-prefill", default=None, metavar="N|off",
                        help="on CUDA's kernel path, prefill chunks of N tokens or more attend "
                             "over their gathered blocks (dispatch.gathered_prefill), off: the "
                             "paged kernel for every chunk (default: the engine's, "
                             "model_adapter.GATHERED_PREFILL_FROM)")
    args = parser.parse_args(argv)
    from engine.runner import model_adapter
    from engine.sched import prefill_budget, scheduler

    model_adapter.STORE_IN_PLACE = args.kv_write == "store"
    if args.gathered_prefill is not None:
        model_adapter.GATHERED_PREFILL_FROM = (None if args.gathered_prefill == "off"
                                               else int(args.gathered_prefill))
    if args.budget_probe == "off":
        prefill_budget.PROBE_AFTER = 10**9
    if args.yield_free == "off":  # the A/B's "before": a yielding prompt gets the share only
        scheduler.YieldShare.cap = lambda self, taken: self.share
    parts = set(args.parts.split(","))
    if args.quick:
        small = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=64)
        shapes = {"tiny": small}
        ns, prompt_len, gen, vocab, kv_mib = [1, 4], 32, 8, 1000, 64.0
        att = [("tiny", 4, 64)]
        mixed_args = (small, 300, 32, 3, 8, vocab, kv_mib)
        agree = (small, 4, 32, 8, vocab, kv_mib)
        paste_args = (small, 2, 32, 600, 16, 8, vocab, kv_mib, args.repeats)
        kv8_args = [("tiny", small, 4, [(32, 8)], vocab, kv_mib, args.repeats)]
    else:
        shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
        ns, prompt_len, gen, vocab, kv_mib = [1, 8, 32, 64], 128, 128, VOCAB, 8192.0
        att = [(s, n, c) for s in ("1B", "8B") for n, c in ((64, 256), (8, 2048), (64, 2048))]
        mixed_args = (SHAPES["1B"], 2500, 128, 7, 128, VOCAB, kv_mib)
        agree = (SHAPES["1B"], 64, 128, 32, VOCAB, kv_mib)
        paste_args = (SHAPES["1B"], 4, 128, 8000, 64, 64, VOCAB, kv_mib, args.repeats)
        kv8_contexts = [tuple(int(x) for x in pair.split(":"))
                        for pair in args.kv8_contexts.split(",")]
        kv8_args = [(name, SHAPES[name], 64, kv8_contexts, VOCAB, 24576.0, args.repeats)
                    for name in shapes]
    from engine.attention.dispatch import kernel_path

    results: dict = dict(device=str(mx.default_device()), path=kernel_path() or "reference",
                         gen_tokens=gen, throughput=[], attention=[], repeats=args.repeats,
                         agreement=(0, 0, "not run", {}), mixed=None, paste=None,
                         agree_tokens=agree[3],
                         note=f"prompts {prompt_len} tokens, {gen} new tokens, "
                              f"block size {BLOCK_SIZE}, engine prefill chunk {PREFILL_CHUNK}, "
                              f"mlx {mx.__version__}"
                              + ("" if args.kv_write == "store" else
                                 "; K/V written by MLX's scatters (--kv-write scatter)")
                              + ("" if args.budget_probe == "on" else
                                 "; the prefill budget does not probe (--budget-probe off)")
                              + ("" if args.yield_free == "on" else
                                 "; a yielding paste takes its share only (--yield-free off)")
                              + ("" if model_adapter.GATHERED_PREFILL_FROM is None else
                                 f"; prefill chunks of {model_adapter.GATHERED_PREFILL_FROM} "
                                 "tokens or more attend over their gathered blocks "
                                 "(--gathered-prefill)"))
    t0 = time.perf_counter()

    def save():
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))

    if "attention" in parts and kernel_path():
        for name, n, ctx in att:
            if name not in SHAPES and not args.quick:
                continue
            row = attention_case(SHAPES.get(name, shapes.get(name)), n, ctx, mx.bfloat16,
                                 repeats=20)
            row["shape"] = name
            results["attention"].append(row)
            print(json.dumps(row), flush=True)
            save()
    if "throughput" in parts:
        for name, shape in shapes.items():
            rows = throughput(name, ns, prompt_len, gen, vocab, shape, kv_mib, args.repeats)
            results["throughput"] += [dict(vars(r), ratio=r.ratio) for r in rows]
            save()
    if "agreement" in parts:
        results["agreement"] = agreement(*agree)
        print("agreement", results["agreement"], flush=True)
        save()
    if "mixed" in parts:
        results["mixed"] = mixed(*mixed_args)
        print("mixed", results["mixed"], flush=True)
        save()
    if "kv8" in parts:
        results["kv8"] = [row for a in kv8_args for row in kv8_throughput(*a)]
        save()
    if "paste" in parts:
        results["paste"] = paste(*paste_args, prefill_target=args.prefill_target,
                                 warm_scenario=args.paste_warmup,
                                 fresh_budget=args.fresh_budget,
                                 fresh_sessions=args.fresh_sessions)
        print("paste", json.dumps(results["paste"]), flush=True)
        save()
    results["elapsed_s"] = time.perf_counter() - t0
    save()
    text = report(results)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
