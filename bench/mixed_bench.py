"""Engine workloads of issue #18, side by side in one run (engine_bench can call them):

    python -m bench.mixed_bench [--quick]    (full sizes write bench/results/mixed.md)

(a) mixed lengths: one long document chat and seven short chats decoding together, against
    mlx-lm's ``batch_generate`` (which pads every row to the longest prompt), and against the
    engine's own parts run apart (the document's prefill alone + the short chats alone);
(b) long paste: first-token time and decode tokens/s of a short chat while a long prompt
    prefills, against the same chat alone;
(c) the step's time split (schedule, build, forward, sample, bookkeeping) at 8 chats, and
    the time to build one step's batch at 8 and 64 sequences;
(d) throughput at 1 and 8 chats against ``batch_generate``, and 8 chats with overlapped
    steps on and off.

Every ratio compares runs made one after the other in this process: on a shared machine the
absolute numbers move, the ratios much less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm import batch_generate

from engine import Engine, EngineConfig, SamplingParams, TokenEvent
from engine.config import overlap_steps
from engine.models.resolve import load_model
from engine.runner.step_batch import build_step_batch
from engine.sched.work import SequenceWork

RESULT = Path(__file__).parent / "results" / "mixed.md"

SHORT_QUESTIONS = [
    "What is the capital of France?", "Name three colours of the rainbow.",
    "How many legs does a spider have?", "What is 12 times 12?",
    "Say hello in Spanish.", "Give me a tip for learning to cook.",
    "Why is the sky blue?", "Write a haiku about the sea.",
]


def document(tokens: int, count) -> str:
    """A deterministic report of about ``tokens`` tokens (``count`` counts a text's)."""
    lines = []
    i = 0
    while True:
        lines.append(f"Section {i}: the warehouse in district {i % 17} received {3 * i + 7} "
                     f"crates of apples and shipped {2 * i + 5} of them to the market.")
        i += 1
        if i % 8 == 0 and count("\n".join(lines)) >= tokens:
            return "\n".join(lines)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@dataclass
class Timed:
    seconds: float
    generated: int


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int, tag: str) -> Timed:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    handles = [engine.submit(prompt_tokens=p, params=params, session_id=f"{tag}-{i}")
               for i, p in enumerate(prompts)]
    finals = [h.result()[0] for h in handles]
    return Timed(time.perf_counter() - start, sum(f.usage.generated_tokens for f in finals))


def run_parts(doc: list[int], shorts: list[list[int]], reply: int) -> tuple[Timed, Timed]:
    """The mixed workload's parts one after the other (the document, then the short chats)
    on a fresh engine, so neither finds the other run's blocks in the prefix cache."""
    fresh = Engine(EngineConfig(kv_memory_mib=256, block_size=16))
    fresh.start()
    if not fresh.wait_ready():
        raise SystemExit(f"engine failed to load: {fresh.load_error}")
    try:
        return run_engine(fresh, [doc], reply, "doc"), run_engine(fresh, shorts, reply, "shorts")
    finally:
        fresh.stop()


def run_batch_generate(loaded, prompts: list[list[int]], max_tokens: int) -> Timed:
    start = time.perf_counter()
    response = batch_generate(loaded.model, loaded.tokenizer, prompts, max_tokens=max_tokens,
                              return_token_ids=True)
    return Timed(time.perf_counter() - start, sum(len(ids) for ids in response.token_ids))


def short_chat_alone_and_during_paste(engine: Engine, short: list[int], paste: list[int],
                                      max_tokens: int) -> dict[str, float]:
    """TTFT and decode tok/s of ``short`` alone, then while ``paste`` prefills."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    alone = engine.submit(prompt_tokens=short, params=params, session_id="lp-alone").result()[0]
    long = engine.submit(prompt_tokens=paste, params=SamplingParams(temperature=0.0,
                                                                    max_tokens=2),
                         session_id="lp-paste")
    while True:  # wait until the paste is really prefilling (polling the snapshot)
        stats = engine.snapshot().sessions.get("lp-paste")
        if stats is not None and stats.prompt_tokens_done > 0:
            break
        time.sleep(0.01)
    during = engine.submit(prompt_tokens=short, params=params, session_id="lp-during")
    for event in during:
        if not isinstance(event, TokenEvent):
            final = event
    stats = engine.snapshot().sessions.get("lp-paste")
    still_prefilling = stats is not None and stats.prompt_tokens_done < len(paste)
    long.result()
    return {
        "ttft_alone": alone.usage.time_to_first_token_s,
        "ttft_during": final.usage.time_to_first_token_s,
        "tps_alone": alone.usage.decode_tokens_per_s,
        "tps_during": final.usage.decode_tokens_per_s,
        "paste_still_prefilling": float(still_prefilling),
    }


def build_time_ms(sequences: int, context: int, block_size: int = 16, repeats: int = 50) -> float:
    """Median time to build one decode step's batch for ``sequences`` sequences."""
    blocks_each = -(-context // block_size)
    works = [SequenceWork([1], context - 1, list(range(i * blocks_each, (i + 1) * blocks_each)),
                          [(i * blocks_each + (context - 1) // block_size,
                            (context - 1) % block_size)])
             for i in range(sequences)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        build_step_batch(works)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller prompts (smoke run)")
    parser.add_argument("--doc-tokens", type=int, help="length of the mixed workload's document")
    parser.add_argument("--paste-tokens", type=int, help="length of the long paste")
    parser.add_argument("--reply", type=int, help="tokens per reply")
    args = parser.parse_args(argv)
    doc_tokens, paste_tokens, reply = (400, 600, 12) if args.quick else (2500, 3600, 48)
    doc_tokens = args.doc_tokens or doc_tokens
    paste_tokens = args.paste_tokens or paste_tokens
    reply = args.reply or reply
    tp_tokens = 16 if args.quick else 64
    started, load_before = time.perf_counter(), os.getloadavg()

    engine = Engine(EngineConfig(kv_memory_mib=256, block_size=16))
    engine.start()
    if not engine.wait_ready():
        raise SystemExit(f"engine failed to load: {engine.load_error}")
    def count(text: str) -> int:
        return engine.count_tokens(chat(text))

    doc = engine.encode_chat(chat(document(doc_tokens, count) + "\nWhich district got most?"))
    paste = engine.encode_chat(chat(document(paste_tokens, count) + "\nSummarise this."))
    shorts = [engine.encode_chat(chat(q)) for q in SHORT_QUESTIONS[:7]]
    mixed = [doc] + shorts

    eight = [engine.encode_chat(chat(q)) for q in SHORT_QUESTIONS]
    run_engine(engine, eight[:2], 4, "warm")  # first-call costs out of the measurements
    together = run_engine(engine, mixed, reply, "mix")
    run_engine(engine, eight, reply, "eight")
    split = engine.snapshot().counters  # EMAs over the last steps: 8 chats decoding
    # The parts run on a fresh engine: on this one the prefix cache still holds the
    # document's blocks from the mixed run, which made its prefill "alone" nearly free.
    doc_alone, shorts_alone = run_parts(doc, shorts, reply)
    latency = short_chat_alone_and_during_paste(engine, engine.encode_chat(chat("Say hi.")),
                                                paste, reply)
    tp_engine = {n: run_engine(engine, eight[:n], tp_tokens, f"tp{n}") for n in (1, 8)}
    engine.stop()
    # The same 8 chats with overlapped steps the other way round from this backend's
    # default (synchronous on the CPU, overlapped on a GPU).
    overlapped = overlap_steps(EngineConfig(), mx.default_device() == mx.gpu)
    other = Engine(EngineConfig(kv_memory_mib=256, block_size=16, overlap=not overlapped))
    other.start()
    if not other.wait_ready():
        raise SystemExit(f"engine failed to load: {other.load_error}")
    tp_other = run_engine(other, eight, tp_tokens, "other8")
    other.stop()
    reference = load_model("default")
    run_batch_generate(reference, eight[:2], 4)
    tp_mlx = {n: run_batch_generate(reference, eight[:n], tp_tokens) for n in (1, 8)}
    baseline = run_batch_generate(reference, mixed, reply)
    build8, build64 = build_time_ms(8, 600), build_time_ms(64, 600)

    def rate(t: Timed) -> float:
        return t.generated / t.seconds

    parts = doc_alone.seconds + shorts_alone.seconds
    non_forward = (split.schedule_time_ms + split.build_time_ms + split.sample_time_ms)
    step = split.step_time_ms or 1e-9
    lines = [
        f"Mixed-length and long-paste workloads: document {len(doc)} tokens + 7 short chats, "
        f"replies <= {reply} tokens (greedy); paste {len(paste)} tokens. One run (no "
        f"repeats), {time.perf_counter() - started:.0f} s; load average before "
        f"{load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}.",
        "",
        "| measurement | PagedChat | reference | ratio | target |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| mixed: aggregate tokens/s vs batch_generate | {rate(together):.1f} "
        f"({together.seconds:.1f} s) | {rate(baseline):.1f} ({baseline.seconds:.1f} s) | "
        f"{rate(together) / rate(baseline):.2f}x | >= 6x |",
        f"| mixed: whole workload vs its parts apart | {together.seconds:.1f} s | "
        f"{parts:.1f} s ({doc_alone.seconds:.1f} + {shorts_alone.seconds:.1f}) | "
        f"{together.seconds / parts:.2f}x | <= 1.25x |",
        f"| short chat during a paste: first token | {latency['ttft_during'] * 1e3:.0f} ms | "
        f"{latency['ttft_alone'] * 1e3:.0f} ms alone | "
        f"{latency['ttft_during'] / latency['ttft_alone']:.2f}x | <= 2x |",
        f"| short chat during a paste: decode tokens/s | {latency['tps_during']:.1f} | "
        f"{latency['tps_alone']:.1f} alone | "
        f"{latency['tps_during'] / max(latency['tps_alone'], 1e-9):.2f}x | >= 0.5x |"
        + ("" if latency["paste_still_prefilling"] else " (the paste ended first)"),
        f"| step split at 8 chats (ms, EMA) | schedule {split.schedule_time_ms:.2f}, build "
        f"{split.build_time_ms:.2f}, forward {split.forward_time_ms:.1f}, sample "
        f"{split.sample_time_ms:.2f}, bookkeeping {split.bookkeeping_time_ms:.2f} | step "
        f"{split.step_time_ms:.1f} | {non_forward / step:.1%} outside the forward | <= 5% |",
        f"| building one decode step's batch (600-token contexts) | 8 seqs {build8:.3f} ms, "
        f"64 seqs {build64:.3f} ms | | | |",
    ]
    for n in (1, 8):
        lines.append(f"| {n} chat{'s' if n > 1 else ''}: aggregate tokens/s vs batch_generate | "
                     f"{rate(tp_engine[n]):.1f} | {rate(tp_mlx[n]):.1f} | "
                     f"{rate(tp_engine[n]) / rate(tp_mlx[n]):.2f}x | "
                     f"{'>= 1.0x' if n == 1 else '>= 1.3x'} |")
    lines += [
        f"| tokens/s at 8 chats / at 1 chat | {rate(tp_engine[8]) / rate(tp_engine[1]):.2f}x | "
        f"{rate(tp_mlx[8]) / rate(tp_mlx[1]):.2f}x (batch_generate) | | >= 5x |",
        f"| 8 chats: default steps ({'overlapped' if overlapped else 'synchronous'}) vs "
        f"{'synchronous' if overlapped else 'overlapped'} | {rate(tp_engine[8]):.1f} | "
        f"{rate(tp_other):.1f} | {rate(tp_engine[8]) / rate(tp_other):.2f}x | |",
    ]
    report = "\n".join(lines)
    print(report)
    if not (args.quick or args.doc_tokens or args.paste_tokens or args.reply):
        RESULT.write_text(report + "\n", encoding="utf-8")  # full sizes only
    return report


if __name__ == "__main__":
    main()
