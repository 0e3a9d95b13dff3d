"""The API server against mlx-lm's own server, side by side in one run.

    source scripts/env.sh; .venv/bin/python -m bench.server_bench [--max-tokens 48] [--rounds 1]

Starts `pagedchat serve` and `mlx_lm.server` (on the same converted default-model folder,
with --decode-concurrency / --prompt-concurrency 8) as real processes on loopback, then for
1, 4 and 8 concurrent streaming clients (the official async `openai` client, greedy,
distinct prompts so no server reuses another round's cache) measures aggregate generated
tokens/s and the time to first token (p50/p99). The two servers are measured alternately,
never at once, so they never compete for the CPU. Writes bench/results/server.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai

from bench.workload import SYSTEM_PROMPT
from engine.models.default_model import cache_dir

RESULTS = Path(__file__).parent / "results"
KEY = "pc-bench-key"
CONCURRENCY = (1, 4, 8)
TOPICS = ["a lighthouse", "a dragon who learns to read", "a city under the sea",
          "a robot gardener", "a lost violin", "the first snow of winter",
          "a train that never stops", "a cat who runs a bakery"]
QUESTIONS = [f"Write a long story about {t}." for t in TOPICS]  # replies run to max_tokens


@dataclass
class Run:
    clients: int
    tokens: int
    wall_s: float
    ttfts: list[float]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    def ttft(self, q: float) -> float:
        data = sorted(self.ttfts)
        return data[min(len(data) - 1, round(q * (len(data) - 1)))]


def model_folder() -> Path:
    folders = sorted((cache_dir() / "models").glob("smollm2-135m-instruct-*"))
    if not folders:
        sys.exit("the default model is not converted yet: run `pagedchat --self-test` once")
    return folders[0]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, headers: dict[str, str], timeout: float, proc) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited early ({proc.returncode}): {proc.args}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5):
                return
        except OSError:
            time.sleep(0.5)  # a bench waiting for a process to come up, not a test
    sys.exit(f"{url} did not answer within {timeout}s")


def start_pagedchat(max_batch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.main", "serve", "--port", str(port), "--kv-memory-mib",
         "128", "--max-batch", str(max_batch), "--log-level", "warning"],
        env={**os.environ, "PAGEDCHAT_API_KEY": KEY}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    wait_http(url + "/models", {"Authorization": f"Bearer {KEY}"}, 600, proc)
    return proc, url


def start_mlx_lm(folder: Path, concurrency: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", str(folder), "--host", "127.0.0.1",
         "--port", str(port), "--decode-concurrency", str(concurrency),
         "--prompt-concurrency", str(concurrency), "--temp", "0.0", "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    wait_http(url + "/models", {}, 600, proc)
    return proc, url


async def one_client(client, model: str, question: str, max_tokens: int,
                     t0: float) -> tuple[int, float]:
    stream = await client.chat.completions.create(
        model=model, temperature=0.0, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": SYSTEM_PROMPT},
                  {"role": "user", "content": question}])
    first, chunks, usage = None, 0, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if any(c.delta.content for c in chunk.choices):
            chunks += 1
            if first is None:
                first = time.perf_counter() - t0
    return (usage if usage is not None else chunks), (first if first is not None else 0.0)


async def measure(url: str, model: str, clients: int, max_tokens: int, tag: str) -> Run:
    async with openai.AsyncOpenAI(base_url=url, api_key=KEY, timeout=600,
                                  max_retries=0) as client:
        questions = [f"[{tag} {i}] {QUESTIONS[i % len(QUESTIONS)]}" for i in range(clients)]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_client(client, model, q, max_tokens, t0)
                                         for q in questions))
        wall = time.perf_counter() - t0
    return Run(clients, sum(r[0] for r in results), wall, [r[1] for r in results])


def first_model(url: str) -> str:
    client = openai.OpenAI(base_url=url, api_key=KEY, timeout=60, max_retries=0)
    return client.models.list().data[0].id


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds per setting")
    args = p.parse_args(argv)
    folder = model_folder()
    started = time.perf_counter()
    load_before = load_average()
    ours, ours_url = start_pagedchat(max(CONCURRENCY))
    theirs, theirs_url = start_mlx_lm(folder, max(CONCURRENCY))
    servers = {"pagedchat": (ours_url, first_model(ours_url)),
               "mlx_lm.server": (theirs_url, str(folder))}
    runs: dict[tuple[str, int], list[Run]] = {}
    try:
        for name, (url, model) in servers.items():  # warm both up (first-request costs)
            asyncio.run(measure(url, model, 1, 4, f"warm {name}"))
        for clients in CONCURRENCY:
            for r in range(args.rounds):
                order = list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]
                for name, (url, model) in order:
                    run = asyncio.run(measure(url, model, clients, args.max_tokens,
                                              f"{name} c{clients} r{r}"))
                    runs.setdefault((name, clients), []).append(run)
                    print(f"{name:14s} clients={clients} {run.tok_s:6.1f} tok/s  "
                          f"TTFT p50 {run.ttft(0.5) * 1000:6.0f} ms  p99 "
                          f"{run.ttft(0.99) * 1000:6.0f} ms  ({run.tokens} tokens, "
                          f"{run.wall_s:.1f} s)", flush=True)
    finally:
        for proc in (ours, theirs):
            proc.terminate()
        for proc in (ours, theirs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    elapsed = time.perf_counter() - started
    write_report(runs, args, elapsed, load_before, load_average(), folder)
    return 0


def merged(runs: list[Run]) -> Run:
    return Run(runs[0].clients, sum(r.tokens for r in runs), sum(r.wall_s for r in runs),
               [t for r in runs for t in r.ttfts])


def write_report(runs, args, elapsed: float, load_before: str, load_after: str,
                 folder: Path) -> None:
    lines = [
        "# API server: `pagedchat serve` against `mlx_lm.server`",
        "",
        f"Model folder `{re.sub(str(Path.home()), '~', str(folder))}` for both; greedy, "
        f"{args.max_tokens} new tokens at most per request, streaming chat completions from "
        f"the official async `openai` client; mlx_lm.server with --decode-concurrency 8 "
        f"--prompt-concurrency 8; pagedchat serve with --max-batch 8. {args.rounds} "
        f"alternating round(s) per setting. Load average before/after: {load_before} / "
        f"{load_after} (the machine is shared). Run took {elapsed:.0f} s.",
        "",
        "| clients | pagedchat tok/s | mlx_lm.server tok/s | ratio | pagedchat TTFT p50 / p99 "
        "| mlx_lm.server TTFT p50 / p99 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for clients in CONCURRENCY:
        a, b = merged(runs[("pagedchat", clients)]), merged(runs[("mlx_lm.server", clients)])
        lines.append(
            f"| {clients} | {a.tok_s:.1f} | {b.tok_s:.1f} | {a.tok_s / b.tok_s:.2f}x | "
            f"{a.ttft(0.5) * 1000:.0f} / {a.ttft(0.99) * 1000:.0f} ms | "
            f"{b.ttft(0.5) * 1000:.0f} / {b.ttft(0.99) * 1000:.0f} ms |")
    a8, b8 = merged(runs[("pagedchat", 8)]), merged(runs[("mlx_lm.server", 8)])
    verdict_tps = "met" if a8.tok_s >= 1.3 * b8.tok_s else "**not met**"
    verdict_ttft = "met" if a8.ttft(0.99) < b8.ttft(0.99) else "**not met**"
    lines += [
        "",
        f"Target >= 1.3x throughput at 8 clients: {verdict_tps} "
        f"({a8.tok_s / b8.tok_s:.2f}x). Lower TTFT p99 at 8 clients: {verdict_ttft} "
        f"({a8.ttft(0.99) * 1000:.0f} ms against {b8.ttft(0.99) * 1000:.0f} ms).",
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "server.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
