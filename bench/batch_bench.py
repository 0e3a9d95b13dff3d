"""A batch job's throughput against mlx-lm's ``batch_generate`` over the same prompts (the
batch-jobs issue's target: >= 0.9x at the same batch size).

``--lines`` chat requests (greedy, ``--tokens`` each at most) run as a batch job exactly as
``pagedchat batch`` runs them (app/server/batch.py: parsing, the endpoints' code path,
tokenisation, an fsync'd output line per request, the final rewrite in input order) on an
engine with ``max_batch`` = B; then the same prompt token ids through ``batch_generate``
with ``completion_batch_size`` = ``prefill_batch_size`` = B (bench/gpu_bench.py's
``mlx_generate``, the project's honest call of it). Generated tokens per second of wall
time, each side timed from its first request to its last token (the model loaded and
warmed up before); A B A B with ``--repeats``; the ratio per pair and how many replies agree
token for token.

    source scripts/env.sh; .venv/bin/python -m bench.batch_bench [--lines 500] [--tokens 32]
        [--batch 16] [--repeats 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from app.server.batch import BatchJob, OutputFile, parse_lines
from bench.gpu_bench import fmt_spread, mlx_generate
from engine import Engine, EngineConfig
from engine.models.resolve import load_model

TOPICS = ["the sea", "a mountain village", "bread", "trains", "the moon", "a library",
          "winter", "bees", "a market", "rivers", "clocks", "the desert", "music", "bridges"]


def batch_rows(n: int, max_tokens: int) -> list[dict]:
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"temperature": 0, "max_tokens": max_tokens, "messages": [
                 {"role": "user", "content": f"Write a few sentences about {TOPICS[i % 14]}, "
                                             f"number {i}."}]}}
            for i in range(n)]


def run_job(engine: Engine, rows: list[dict], concurrency: int, folder: Path):
    lines, bad = parse_lines([json.dumps(r) for r in rows])
    assert not bad, bad
    out = folder / f"out-{time.monotonic_ns()}.jsonl"
    job = BatchJob(lines, OutputFile(out), engine, "bench-batch", concurrency=concurrency)
    start = time.perf_counter()
    progress = asyncio.run(job.run())
    elapsed = time.perf_counter() - start
    assert job.complete and progress.failed == 0
    records = [json.loads(r) for r in out.read_text().splitlines()]
    texts = [r["response"]["body"]["choices"][0]["message"]["content"] for r in records]
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in records)
    return elapsed, tokens, texts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=500)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="the job's requests in flight (default 2x --batch, as the CLI)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--kv-memory-mib", type=float, default=256.0)
    args = parser.parse_args(argv)
    b = args.batch
    concurrency = args.concurrency or 2 * b
    rows = batch_rows(args.lines, args.tokens)
    loaded = load_model("default")
    engine = Engine(EngineConfig(kv_memory_mib=args.kv_memory_mib, max_batch=b))
    engine.start()
    assert engine.wait_ready(900), engine.load_error
    try:
        prompts = [engine.encode_chat(r["body"]["messages"]) for r in rows]
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            run_job(engine, rows[:2 * b], concurrency, folder)  # warm-up
            mlx_generate(loaded, prompts[:b], 8)
            job_tps, mlx_tps, agree = [], [], []
            for _ in range(args.repeats):
                elapsed, tokens, texts = run_job(engine, rows, concurrency, folder)
                job_tps.append(tokens / elapsed)
                m_elapsed, m_tokens = mlx_generate(loaded, prompts, args.tokens)
                mlx_tps.append(sum(map(len, m_tokens)) / m_elapsed)
                tok = loaded.tokenizer
                eos = set(tok.eos_token_ids)
                m_texts = [tok.decode([t for t in ids if t not in eos]) for ids in m_tokens]
                agree.append(sum(a.strip() == m.strip() for a, m in zip(texts, m_texts)))
                print(f"  job {tokens} tokens in {elapsed:.1f}s = {job_tps[-1]:.1f} tok/s; "
                      f"batch_generate {sum(map(len, m_tokens))} tokens in {m_elapsed:.1f}s = "
                      f"{mlx_tps[-1]:.1f} tok/s", flush=True)
        ratios = [j / m for j, m in zip(job_tps, mlx_tps)]
        print(f"lines={args.lines} tokens<={args.tokens} B={b} concurrency={concurrency}: "
              f"batch job {fmt_spread(job_tps)} tok/s, batch_generate(bs={b}) "
              f"{fmt_spread(mlx_tps)} tok/s, ratio {statistics.median(ratios):.2f}x (pairs "
              f"{', '.join(f'{r:.2f}' for r in ratios)}); replies equal to batch_generate's: "
              f"{', '.join(f'{a}/{args.lines}' for a in agree)}", flush=True)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
