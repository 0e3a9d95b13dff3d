"""Issue #26 on the CPU: the engine with the 8-bit pool against the model-precision pool.

    python -m bench.kv8_cpu_throughput [--repeats 5] [--tokens 48] [--chats 8] [--rows ...]

Two engines loaded side by side (the default model, 256 MiB budgets, max_batch = chats),
the same chat prompts run model, int8, model, int8, ..., after a warm-up of the same size;
generated tokens per second of wall time, median (min-max), and the 8-bit / model ratio of
each pair. Target: no throughput loss at 8 chats.

Four rows: greedy and the app's default sampling, each with drafting as the app ships it
(on, on the CPU) and off. The drafts-off rows are the pools' own cost: an 8-bit pool
changes some greedy replies (bench/results/kv8.md: 7 of 20 identical), sampled replies
differ from run to run anyway, and with drafting on, a reply that repeats itself more gets
more drafts accepted, so those rows also measure which replies each pool happened to write.
``--rows`` picks rows by label (comma-separated), ``--repeats`` their repeats.
"""

from __future__ import annotations

import argparse
import statistics

from bench.cpu_throughput import QUESTIONS
from bench.gpu_bench import engine_generate
from engine import Engine, EngineConfig

#: (label, sampling workload of bench/gpu_bench.py, drafting)
ROWS = (("greedy", "greedy", None), ("app-sampling", "app-sampling", None),
        ("greedy (drafts off)", "greedy", False),
        ("app-sampling (drafts off)", "app-sampling", False))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--rows", default=",".join(label for label, *_ in ROWS),
                        help="comma-separated row labels")
    args = parser.parse_args()
    wanted = args.rows.split(",")
    unknown = set(wanted) - {label for label, *_ in ROWS}
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; the rows: {[r[0] for r in ROWS]}")
    print(f"{args.chats} chats, {args.tokens} new tokens, {args.repeats} interleaved repeats; "
          "tok/s median (min-max); int8 / model: median of the pairs' ratios (min-max)\n")
    print("| workload | model pool | 8-bit pool | int8 / model |\n| --- | ---: | ---: | ---: |")
    for label, workload, speculative in (r for r in ROWS if r[0] in wanted):
        engines = {}
        try:
            for precision in ("model", "int8"):
                eng = Engine(EngineConfig(kv_memory_mib=256.0, max_batch=args.chats,
                                          kv_precision=precision, speculative=speculative))
                eng.start()
                assert eng.wait_ready(900), eng.load_error
                engines[precision] = eng
            prompts = [engines["model"].encode_chat([{"role": "user", "content": q}])
                       for q in QUESTIONS[:args.chats]]
            for eng in engines.values():
                engine_generate(eng, prompts, args.tokens, workload)  # warm-up
            tps: dict[str, list[float]] = {p: [] for p in engines}
            for _ in range(args.repeats):
                for precision, eng in engines.items():
                    elapsed, tokens = engine_generate(eng, prompts, args.tokens, workload)
                    tps[precision].append(sum(map(len, tokens)) / elapsed)
        finally:
            for eng in engines.values():
                eng.stop()
        ratios = [b / a for a, b in zip(tps["model"], tps["int8"], strict=True)]
        cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for v in tps.values()]
        print(f"| {label} | {cells[0]} | {cells[1]} | {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)


if __name__ == "__main__":
    main()
