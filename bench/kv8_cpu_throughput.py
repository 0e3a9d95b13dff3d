"""Issue #26 on the CPU: the engine with the 8-bit pool against the model-precision pool.

    python -m bench.kv8_cpu_throughput [--repeats 3] [--tokens 48] [--chats 8]

Two engines loaded side by side (the default model, 256 MiB budgets, max_batch = chats),
the same chat prompts run A B A B, greedy; generated tokens per second of wall time, median
(min-max), and the 8-bit / model ratio per pair. Target: no throughput loss at 8 chats.
"""

from __future__ import annotations

import argparse
import statistics

from bench.cpu_throughput import QUESTIONS
from bench.gpu_bench import engine_generate
from engine import Engine, EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--chats", type=int, default=8)
    args = parser.parse_args()
    engines = {}
    for precision in ("model", "int8"):
        eng = Engine(EngineConfig(kv_memory_mib=256.0, max_batch=args.chats,
                                  kv_precision=precision))
        eng.start()
        assert eng.wait_ready(900), eng.load_error
        engines[precision] = eng
    try:
        prompts = [engines["model"].encode_chat([{"role": "user", "content": q}])
                   for q in QUESTIONS[:args.chats]]
        for eng in engines.values():
            engine_generate(eng, prompts, 8)  # warm-up
        tps: dict[str, list[float]] = {p: [] for p in engines}
        for _ in range(args.repeats):
            for precision, eng in engines.items():
                elapsed, tokens = engine_generate(eng, prompts, args.tokens)
                tps[precision].append(sum(map(len, tokens)) / elapsed)
    finally:
        for eng in engines.values():
            eng.stop()
    ratios = [b / a for a, b in zip(tps["model"], tps["int8"], strict=True)]
    for p, v in tps.items():
        print(f"{p}: {statistics.median(v):.1f} tok/s ({min(v):.1f}-{max(v):.1f})")
    print(f"kv8-cpu: {args.chats} chats, {args.tokens} tokens, int8/model "
          f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
