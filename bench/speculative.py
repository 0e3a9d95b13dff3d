"""Speculative decoding (issue #28), with and without drafts, side by side.

    python -m bench.speculative [--repeats N] [--edit-tokens N]

Two engines on the default model, one with ``EngineConfig.speculative`` on and one off,
run the same workloads in turn (off, on, off, on, ...: a slow spell of the machine hits
both sides); each ratio is the median of the per-repeat ratios, with their spread.

* **edit**: one chat asked to repeat a 150-line code file with one change (greedy): the
  decode tokens/s of the reply (``Usage.decode_tokens_per_s``; its prompt is in the prefix
  cache after the warm-up on both sides).
* **chat**: one ordinary question, sampled (temperature 0.7): decode tokens/s.
* **regenerate x3**: one prompt, n = 3 sampled replies: aggregate tokens/s (all tokens over
  the wall time).
* **8 chats**: eight different questions at once, sampled: aggregate tokens/s.

Writes bench/results/speculative.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from engine import Engine, EngineConfig, FinalEvent, SamplingParams

RESULTS = Path(__file__).parent / "results"

QUESTIONS = [
    "How does bread rise?", "Why is the sky blue?", "How do tides work?",
    "What does a compiler do?", "Why do cats purr?", "How do vaccines work?",
    "How do airplanes fly?", "What is a black hole?",
]


def code_file(lines: int = 150) -> str:
    """A plain Python module of ``lines`` lines (small functions over an inventory)."""
    out = ['"""Inventory helpers."""', ""]
    i = 0
    while len(out) < lines:
        out += [f"def restock_{i}(items, amount):",
                f"    total = sum(item.count for item in items) + amount * {i + 1}",
                f"    return min(total, {100 + 10 * i})", ""]
        i += 1
    return "\n".join(out[:lines])


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def run(engine: Engine, prompts: list[list[dict]], params: SamplingParams) -> dict:
    """Submit every prompt at once; decode tokens/s of the first reply, and aggregate."""
    t0 = time.perf_counter()
    handles = [engine.submit(messages=m, params=params, session_id=f"bench-{i}")
               for i, m in enumerate(prompts)]
    finals: list[FinalEvent] = []
    for h in handles:
        finals += [e for e in h if isinstance(e, FinalEvent)]
    wall = time.perf_counter() - t0
    generated = sum(f.usage.generated_tokens for f in finals)
    return {"decode": finals[0].usage.decode_tokens_per_s, "aggregate": generated / wall,
            "tokens": generated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--edit-tokens", type=int, default=192)
    args = parser.parse_args()
    edit = messages("Repeat this file exactly, but rename restock_7 to refill_7. Answer with "
                    f"the code only.\n\n```python\n{code_file()}\n```")
    sampled = SamplingParams(temperature=0.7, max_tokens=64)
    workloads = [
        ("edit (1 chat, greedy)", [edit],
         SamplingParams(temperature=0.0, max_tokens=args.edit_tokens), "decode", 2.0),
        ("chat (1 chat, sampled)", [messages(QUESTIONS[0])], sampled, "decode", 0.97),
        ("regenerate x3 (n=3, sampled)", [messages(QUESTIONS[1])],
         SamplingParams(temperature=0.7, max_tokens=64, n=3), "aggregate", 1.3),
        ("8 chats (sampled)", [messages(q) for q in QUESTIONS], sampled, "aggregate", 0.97),
    ]
    engines = {}
    for on in (False, True):
        engines[on] = Engine(EngineConfig(kv_memory_mib=256, speculative=on))
        engines[on].start()
        assert engines[on].wait_ready(600), engines[on].load_error
    results: dict[str, dict[bool, list[dict]]] = {w[0]: {False: [], True: []} for w in workloads}
    for _name, prompts, params, _, _ in workloads:  # warm-up: shapes, prefix cache
        for on in (False, True):
            run(engines[on], prompts, params)
    for _ in range(args.repeats):
        for name, prompts, params, _, _ in workloads:
            for on in (False, True):
                results[name][on].append(run(engines[on], prompts, params))
    counters = engines[True].snapshot().counters
    for e in engines.values():
        e.stop()
    rows = []
    for name, _, _, metric, target in workloads:
        off = [r[metric] for r in results[name][False]]
        on = [r[metric] for r in results[name][True]]
        ratios = [b / a for a, b in zip(off, on)]
        verdict = ("met" if min(ratios) >= target else
                   "missed" if max(ratios) < target else "inconclusive")
        rows.append(f"| {name} | {metric} tok/s | {statistics.median(off):.1f} "
                    f"({min(off):.1f}-{max(off):.1f}) | {statistics.median(on):.1f} "
                    f"({min(on):.1f}-{max(on):.1f}) | {statistics.median(ratios):.2f}x "
                    f"({min(ratios):.2f}-{max(ratios):.2f}) | >= {target}x: {verdict} |")
    text = "\n".join([
        "# Speculative decoding (issue #28)", "",
        f"`python -m bench.speculative --repeats {args.repeats} --edit-tokens "
        f"{args.edit_tokens}` (default model, CPU, OpenBLAS preloaded; {args.repeats} "
        "repeats, off/on interleaved; medians with min-max; the ratio is the median of the "
        "per-repeat ratios).", "",
        "| workload | metric | drafts off | drafts on | on / off | target |",
        "| --- | --- | --- | --- | --- | --- |", *rows, "",
        f"Drafting engine's counters at the end: {counters.draft_tokens} draft tokens "
        f"verified, {counters.accepted_draft_tokens} accepted "
        f"({counters.draft_acceptance:.0%}), in {counters.verify_rows} verify rows.", "",
    ])
    (RESULTS / "speculative.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
