"""GPU bench (MLX's CUDA backend): the engine against mlx-lm's ``batch_generate``, and paged
attention alone, in one run. Written for the lent H200 (``docs/GPU.md``); runs anywhere
MLX runs (slowly on the CPU: ``--quick`` shrinks everything for a smoke run).

    python -m bench.gpu_bench [--quick] [--out bench/results/gpu.md]

* Models: random-weight llama models with Llama-3.2-1B and Llama-3.1-8B shapes in bf16
  (throughput depends on shapes, not weight values), a word-level tokenizer stand-in with the
  full vocabulary and no EOS, 128-token prompts given as ``prompt_tokens``, 128 greedy tokens,
  n = 1, 8, 32, 64 concurrent requests. Each side is warmed up first (NVRTC compiles one
  module per kernel instantiation).
* Attention alone, all layers of a step: the paged kernel reading the pool through block
  tables, contiguous unmasked SDPA over the same tokens (the floor), and the gather path.
* Greedy agreement, fp32 weights: engine tokens == batch_generate tokens per sequence.
* Mixed-length workload: one ~2,500-token prompt and 7 short ones decoding together, against
  batch_generate (which pads every row to the longest prompt), and the engine's own parts
  run apart (the long prompt alone, then the short ones alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def make_tokenizer(vocab: int):
    """A real tokenizer (tokenizers WordLevel, one word per id) wrapped as mlx-lm wraps any:
    the engine and batch_generate detokenize through it. No EOS: every request runs to
    max_tokens on both sides."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok))


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
    from engine.model_folder import LoadedModel

    return LoadedModel(model=model, tokenizer=tokenizer, name=name, path=Path("."),
                       model_type="llama", max_context=8192, dtype=dtype)


PREFILL_CHUNK = 2048  # prompt tokens per engine step (the app's default is 256)


def start_engine(loaded, max_batch: int, kv_mib: float, attention_mode: str = "auto"):
    """An Engine serving ``loaded`` (its loader is pointed at the in-memory model)."""
    import engine.loading as loading
    from engine import Engine, EngineConfig

    loading.load_model = lambda spec, quantized=None: loaded
    eng = Engine(EngineConfig(kv_memory_mib=kv_mib, block_size=BLOCK_SIZE,
                              max_batch=max_batch, attention=attention_mode,
                              prefill_chunk=PREFILL_CHUNK))
    eng.start()
    if not eng.wait_ready():
        raise SystemExit(f"engine failed to load: {eng.load_error}")
    return eng


class StepProfile:
    """Where an engine step's time goes, averaged over a run: the engine's own per-step phase
    times (engine.telemetry.StepTimes: schedule, build = batch metadata + the model's lazy
    graph, forward = waiting for the device, sample, bookkeeping), read after every step by a
    wrapper on the step runner (removed by close())."""

    PARTS = ("schedule", "build", "forward", "sample", "bookkeeping")

    def __init__(self, eng) -> None:
        self.stepper = stepper = eng.runtime.stepper
        self.totals = dict.fromkeys(("step", *self.PARTS), 0.0)
        self.steps = 0
        real_step = stepper.step

        def step():
            t0 = time.perf_counter()
            real_step()
            elapsed = time.perf_counter() - t0
            times = stepper._times
            if times.forward > 0:  # a step that ran the model
                self.steps += 1
                self.totals["step"] += elapsed
                for name in self.PARTS:
                    self.totals[name] += getattr(times, name)

        stepper.step = step

    def close(self) -> dict:
        del self.stepper.step  # back to the class's method
        per = {k: v * 1e3 / max(self.steps, 1) for k, v in self.totals.items()}
        per["steps"] = self.steps
        return per


def engine_generate(eng, prompts: list[list[int]], max_tokens: int):
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    handles = [eng.submit(prompt_tokens=p, params=params, session_id=f"b-{i}")
               for i, p in enumerate(prompts)]
    for h in handles:
        h.result()
    elapsed = time.perf_counter() - start
    from engine.events import TokenEvent

    tokens = [[t for e in h if isinstance(e, TokenEvent) for t in e.token_ids] for h in handles]
    return elapsed, tokens


def mlx_generate(loaded, prompts: list[list[int]], max_tokens: int):
    from mlx_lm import batch_generate

    start = time.perf_counter()
    response = batch_generate(loaded.model, loaded.tokenizer, prompts, max_tokens=max_tokens,
                              return_token_ids=True)
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
    from engine.attention import paged_decode, reference_decode

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
    engine_tps: float
    mlx_tps: float
    engine_step_ms: float
    step_split: dict

    @property
    def ratio(self) -> float:
        return self.engine_tps / self.mlx_tps


def throughput(shape_name: str, ns: list[int], prompt_len: int, gen_tokens: int,
               vocab: int, shape: dict, kv_mib: float) -> list[ThroughputRow]:
    tokenizer = make_tokenizer(vocab)
    model = make_model(shape, mx.bfloat16, vocab)
    loaded = loaded_model(model, tokenizer, f"random-{shape_name}", mx.bfloat16)
    eng = start_engine(loaded, max_batch=max(ns), kv_mib=kv_mib)
    print(f"[{shape_name}] attention path: {eng.model_info.attention}", flush=True)
    rows = []
    try:
        for n in ns:
            prompts = prompts_for(n, prompt_len, vocab, seed=n)
            engine_generate(eng, prompts, 8)  # warm-up (kernel compiles)
            mlx_generate(loaded, prompts, 8)
            e_time, e_tokens = engine_generate(eng, prompts, gen_tokens)
            m_time, m_tokens = mlx_generate(loaded, prompts, gen_tokens)
            e_tps = sum(map(len, e_tokens)) / e_time
            m_tps = sum(map(len, m_tokens)) / m_time
            prof = StepProfile(eng)  # a second engine run, profiled (not the timed one)
            try:
                engine_generate(eng, prompts, gen_tokens)
            finally:
                split = prof.close()
            rows.append(ThroughputRow(shape_name, n, e_tps, m_tps, e_time * 1e3 / gen_tokens,
                                      split))
            print(f"[{shape_name}] n={n}: engine {e_tps:.1f} tok/s, batch_generate "
                  f"{m_tps:.1f} tok/s, ratio {e_tps / m_tps:.2f}x; step split (ms) "
                  f"{ {k: round(v, 3) for k, v in split.items()} }", flush=True)
    finally:
        eng.stop()
    del model, loaded
    mx.clear_cache()
    return rows


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


# ---------------------------------------------------------------------------------------------


def report(results: dict) -> str:
    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    lines = [f"Device: {results['device']}; attention path: {results['path']}; "
             f"{results['note']}", ""]
    lines += ["## Engine vs mlx-lm batch_generate (aggregate generated tokens/s, bf16)", "",
              "| shape | n | engine | batch_generate | ratio | target | verdict |",
              "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in results["throughput"]:
        target = 1.0 if r["n"] == 1 else 1.3
        lines.append(f"| {r['shape']} | {r['n']} | {r['engine_tps']:.1f} | {r['mlx_tps']:.1f} | "
                     f"{r['ratio']:.2f}x | >= {target}x | {verdict(r['ratio'] >= target)} |")
    lines += ["", "Engine step split (profiled second run, mean ms per step from the engine's "
              "own phase times: build = batch metadata + model graph, forward = waiting for "
              "the device), and the timed run's wall time per generated-token step (prefill "
              "included) of both:",
              "", "| shape | n | step | schedule | build | forward | sample | bookkeeping | "
              "engine wall per step | batch_generate wall per step |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results["throughput"]:
        sp = r["step_split"]
        mlx_step = 1e3 * r["n"] / r["mlx_tps"]
        engine_step = 1e3 * r["n"] / r["engine_tps"]  # the timed run's wall time per token
        lines.append(f"| {r['shape']} | {r['n']} | {sp['step']:.2f} | {sp['schedule']:.2f} | "
                     f"{sp['build']:.2f} | {sp['forward']:.2f} | {sp['sample']:.2f} | "
                     f"{sp['bookkeeping']:.2f} | {engine_step:.2f} | {mlx_step:.2f} |")
    lines += ["", "## Decode attention alone, all layers of one step (median ms)", "",
              "| shape | n | context | paged kernel | contiguous SDPA | gather path | "
              "paged / SDPA | graph build paged / SDPA | K/V GB/s (paged) | max abs err | "
              "target | verdict |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in results["attention"]:
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['context']} | {r['paged_ms']:.3f} | "
            f"{r['sdpa_ms']:.3f} | {r['gather_ms']:.3f} | {r['paged_over_sdpa']:.2f}x | "
            f"{r.get('paged_build_ms', float('nan')):.3f} / "
            f"{r.get('sdpa_build_ms', float('nan')):.3f} | {r['paged_GBps']:.0f} | "
            f"{r['max_abs_err']:.2g} | <= 1.2x | "
            f"{verdict(r['paged_over_sdpa'] <= 1.2)} |")
    eq, n, path, pairs = results["agreement"]
    lines += ["", f"Greedy agreement, fp32 1B-shape weights, {n} sequences x "
              f"{results.get('agree_tokens', '?')} tokens: {eq}/{n} equal token for token "
              f"(engine path {path} vs batch_generate). Per pair (equal sequences; first "
              f"differing token index of the others): "
              + "; ".join(f"{k} {v['equal']}/{n} {v['first_diff']}" for k, v in pairs.items())
              + "."]
    m = results["mixed"]
    lines += ["", "## Mixed-length workload (bf16, 1B shape)", "",
              f"One {m['long_len']}-token prompt + {m['shorts']} x {m['short_len']}-token "
              f"prompts, {results['gen_tokens']} greedy tokens each.", "",
              "| | engine | batch_generate | ratio | target | verdict |",
              "| --- | ---: | ---: | ---: | --- | --- |",
              f"| wall time | {m['engine_s']:.2f} s | {m['mlx_s']:.2f} s | {m['ratio']:.2f}x | "
              f">= 2x | {verdict(m['ratio'] >= 2)} |",
              f"| vs its parts run apart | {m['engine_s']:.2f} s | {m['parts_s']:.2f} s (parts) | "
              f"{m['within']:.2f}x | <= 1.25x | {verdict(m['within'] <= 1.25)} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="PagedChat GPU bench")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="markdown report path")
    parser.add_argument("--json", type=Path, default=None, help="raw numbers path")
    parser.add_argument("--parts", default="attention,throughput,agreement,mixed")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if args.quick:
        small = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=64)
        shapes = {"tiny": small}
        ns, prompt_len, gen, vocab, kv_mib = [1, 4], 32, 8, 1000, 64.0
        att = [("tiny", 4, 64)]
        mixed_args = (small, 300, 32, 3, 8, vocab, kv_mib)
        agree = (small, 4, 32, 8, vocab, kv_mib)
    else:
        shapes = SHAPES
        ns, prompt_len, gen, vocab, kv_mib = [1, 8, 32, 64], 128, 128, VOCAB, 8192.0
        att = [(s, n, c) for s in ("1B", "8B") for n, c in ((64, 256), (8, 2048), (64, 2048))]
        mixed_args = (SHAPES["1B"], 2500, 128, 7, 128, VOCAB, kv_mib)
        agree = (SHAPES["1B"], 64, 128, 32, VOCAB, kv_mib)
    from engine.attention import kernel_path

    results: dict = dict(device=str(mx.default_device()), path=kernel_path() or "reference",
                         gen_tokens=gen, throughput=[], attention=[],
                         agreement=(0, 0, "not run", {}), mixed=None,
                         agree_tokens=agree[3],
                         note=f"prompts {prompt_len} tokens, {gen} greedy tokens, "
                              f"block size {BLOCK_SIZE}, engine prefill chunk {PREFILL_CHUNK}, "
                              f"mlx {mx.__version__}")
    t0 = time.perf_counter()

    def save():
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))

    if "attention" in parts and kernel_path():
        for name, n, ctx in att:
            row = attention_case(shapes[name], n, ctx, mx.bfloat16, repeats=20)
            row["shape"] = name
            results["attention"].append(row)
            print(json.dumps(row), flush=True)
            save()
    if "throughput" in parts:
        for name, shape in shapes.items():
            rows = throughput(name, ns, prompt_len, gen, vocab, shape, kv_mib)
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
    results["elapsed_s"] = time.perf_counter() - t0
    save()
    if results["mixed"] is not None and results["agreement"][1]:
        text = report(results)
        print(text)
        if args.out:
            args.out.write_text(text)


if __name__ == "__main__":
    main()
