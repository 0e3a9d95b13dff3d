"""Overlapped steps with the app's default sampling: does every chat overlap, and what does
it buy?

Runs ``--chats`` chats of ``--tokens`` tokens each (all submitted together, each to its
``max_tokens``) on one engine per setting: greedy and the app's default sampling
(temperature 0.3, top-p 0.9, repetition penalty 1.15 over 128 tokens; seeded), steps
overlapped and not, the settings interleaved over ``--repeats`` rounds. Prints, per setting,
the median generated tokens per second (with min-max), the engine's steps per generated token
per chat (1.0: every chat decoded in every step) and the share of steps launched before the
previous step's tokens were read (``StepRunner.launched_ahead``; "-" on code without it).
It runs on older checkouts too (``PYTHONPATH=<checkout>``), to compare before and after.

    source scripts/env.sh; .venv/bin/python -m bench.overlap_bench [--model default]
        [--chats 8] [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine import Engine, EngineConfig, SamplingParams

APP_DEFAULT = dict(temperature=0.3, top_p=0.9, repetition_penalty=1.15,
                   repetition_context_size=128)
QUESTIONS = ["Describe a quiet harbour at dawn.", "Explain how bread rises.",
             "Write a short letter to a friend.", "List some uses of copper.",
             "Tell a story about a lost key.", "Why is the sky blue?",
             "Give advice for a first job.", "Describe a busy market."]


def one_run(model: str, chats: int, tokens: int, sampling: str, overlap: bool) -> dict:
    eng = Engine(EngineConfig(model=model, kv_memory_mib=256, max_batch=max(8, chats),
                              overlap=overlap))
    eng.start()
    try:
        assert eng.wait_ready(600), eng.load_error
        rt = eng.runtime
        steps0 = rt.scheduler.steps
        ahead0 = getattr(rt.stepper, "launched_ahead", None)
        t0 = time.perf_counter()
        handles = []
        for i in range(chats):
            params = (SamplingParams(temperature=0.0, max_tokens=tokens) if sampling == "greedy"
                      else SamplingParams(**APP_DEFAULT, max_tokens=tokens, seed=i))
            handles.append(eng.submit(
                messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                params=params, session_id=f"bench-{i}"))
        generated = 0
        for h in handles:
            for event in h:
                generated += len(getattr(event, "token_ids", ()))
        elapsed = time.perf_counter() - t0
        steps = rt.scheduler.steps - steps0
        ahead = (rt.stepper.launched_ahead - ahead0) if ahead0 is not None else None
    finally:
        eng.stop()
    return {"tok_s": generated / elapsed, "steps_per_token": steps * chats / generated,
            "ahead": None if ahead is None else ahead / max(1, steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = [(s, o) for s in ("greedy", "app-default") for o in (True, False)]
    runs: dict[tuple, list[dict]] = {k: [] for k in settings}
    for _ in range(args.repeats):
        for sampling, overlap in settings:
            runs[sampling, overlap].append(
                one_run(args.model, args.chats, args.tokens, sampling, overlap))
    print(f"{args.chats} chats x {args.tokens} tokens, model {args.model}, "
          f"{args.repeats} repeats (median, min-max)")
    print(f"{'sampling':12} {'overlap':8} {'tok/s':>22} {'steps/token':>12} {'ahead':>6}")
    for (sampling, overlap), rs in runs.items():
        rates = [r["tok_s"] for r in rs]
        spt = statistics.median(r["steps_per_token"] for r in rs)
        ahead = rs[0]["ahead"]
        ahead_s = "-" if ahead is None else f"{statistics.median(r['ahead'] for r in rs):.2f}"
        print(f"{sampling:12} {str(overlap):8} {statistics.median(rates):8.1f} "
              f"({min(rates):.1f}-{max(rates):.1f}) {spt:12.2f} {ahead_s:>6}")


if __name__ == "__main__":
    main()
