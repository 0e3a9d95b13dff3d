"""The engine against mlx-lm's ``batch_generate`` on the CPU with the default model, the
baseline at its best (the engine-speed issue's CPU targets).

At 1 and 8 chats, greedy and with the app's default sampling (mlx-lm given the same sampler
and repetition penalty as its own sampler and logits processors), ``batch_generate`` with
``completion_batch_size`` = ``prefill_batch_size`` = n and the engine with ``max_batch`` = n,
run A B A B on the same chat prompts (questions that want long answers, so replies run to
``--tokens``); generated tokens per second of wall time, median (min-max), the ratio per
pair, and the engine's step split from one more profiled run: the share of a step that is
not the forward (schedule, build, sample, bookkeeping).

    source scripts/env.sh; .venv/bin/python -m bench.cpu_throughput [--repeats 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics

from bench.gpu_bench import (
    WORKLOADS,
    StepProfile,
    engine_generate,
    fmt_spread,
    mlx_generate,
)
from engine import Engine, EngineConfig
from engine.models.resolve import load_model

QUESTIONS = [
    "Tell me a long story about a lighthouse keeper and a storm.",
    "Explain how a steam engine works, step by step, in detail.",
    "Describe a walk through a busy market in a coastal town.",
    "Write a long letter to a friend about learning to play the piano.",
    "Explain in detail how bread is made, from flour to loaf.",
    "Describe the life cycle of a star, from cloud to remnant.",
    "Tell me about the history of sailing ships in great detail.",
    "Explain how a city plans its public transport, step by step.",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--chats", default="1,8")
    args = parser.parse_args(argv)
    loaded = load_model("default")
    for n in (int(c) for c in args.chats.split(",")):
        eng = Engine(EngineConfig(kv_memory_mib=256.0, max_batch=n))
        eng.start()
        assert eng.wait_ready(900), eng.load_error
        try:
            prompts = [eng.encode_chat([{"role": "user", "content": q}])
                       for q in QUESTIONS[:n]]
            for workload in WORKLOADS:
                engine_generate(eng, prompts, 8, workload)  # warm-up
                mlx_generate(loaded, prompts, 8, workload)
                e_tps, m_tps = [], []
                for _ in range(args.repeats):
                    e_time, e_tokens = engine_generate(eng, prompts, args.tokens, workload)
                    m_time, m_tokens = mlx_generate(loaded, prompts, args.tokens, workload)
                    e_tps.append(sum(map(len, e_tokens)) / e_time)
                    m_tps.append(sum(map(len, m_tokens)) / m_time)
                prof = StepProfile(eng)
                try:
                    engine_generate(eng, prompts, args.tokens, workload)
                finally:
                    split = prof.close()
                host = 1.0 - split["forward"] / split["step"] if split["step"] else 0.0
                ratios = [e / m for e, m in zip(e_tps, m_tps)]
                print(f"n={n} {workload}: engine {fmt_spread(e_tps)} tok/s, batch_generate("
                      f"bs={n}) {fmt_spread(m_tps)} tok/s, ratio {statistics.median(ratios):.2f}x"
                      f" (pairs {', '.join(f'{r:.2f}' for r in ratios)}); not the forward: "
                      f"{100 * host:.1f}% of a step; split (ms) "
                      f"{ {k: round(v, 2) for k, v in split.items()} }", flush=True)
        finally:
            eng.stop()


if __name__ == "__main__":
    main()
