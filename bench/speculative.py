"""Speculative decoding (issue #28), with and without drafts, side by side.

    python -m bench.speculative [--repeats N] [--edit-tokens N]

Two engines on the default model, one with ``EngineConfig.speculative`` on and one off,
run the same workloads in turn (off, on, off, on, ...: a slow spell of the machine hits
both sides); each ratio is the median of the per-repeat ratios, with their spread.

Every run of a workload asks prompts no earlier run asked (another function renamed,
another audience for the question): a drafting engine keeps finished replies as drafts for
later requests with the same prompt, so repeating a prompt would hand it its own earlier
answer. Sampled workloads sample as the app's new chats do
(``app.core.generation_defaults.FALLBACK``: temperature 0.3, top-p 0.9, repetition penalty
1.15 over 128 tokens), at most 64 tokens.

* **edit**: one chat asked to repeat a 150-line code file with one change (greedy): the
  decode tokens/s of the reply (``Usage.decode_tokens_per_s``: its prefill is left out).
  The request names the change before the code and asks for the whole file after it; the
  report says how many of the reply's lines are the file's own (``copied``), so a reply that
  is not the edited file shows. **edit, asked before the code only** is the wording this
  bench used until session 14 (the instruction only before the code): the default model
  answers it with prose about the code, not the file (bench/results/speculative.md), so it
  is reported beside the editing row for comparison, with no target of its own.
* **chat**: one ordinary question: decode tokens/s.
* **regenerate x3**: the app's Regenerate x3 on a chat that has its reply: the reply is
  generated first (not timed, on both sides), then three new replies to the same prompt
  (n = 3): aggregate tokens/s (all tokens over the wall time).
* **n = 3, no earlier reply**: three samples of a new prompt (the API's ``n``): aggregate.
* **8 chats**: eight different questions at once: aggregate tokens/s.

Writes bench/results/speculative.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from app.core.generation_defaults import FALLBACK
from engine import Engine, EngineConfig, FinalEvent, SamplingParams

RESULTS = Path(__file__).parent / "results"
#: One run of a workload: (engine, run index) -> its metrics.
Workload = Callable[[Engine, int], dict]

QUESTIONS = [
    "How does bread rise?", "Why is the sky blue?", "How do tides work?",
    "What does a compiler do?", "Why do cats purr?", "How do vaccines work?",
    "How do airplanes fly?", "What is a black hole?",
]
AUDIENCES = ["a child", "a student", "an engineer", "a farmer", "a painter", "a sailor",
             "a nurse", "a chef", "a pilot", "a gardener", "a teacher", "a musician"]
APP_SAMPLING = replace(FALLBACK, max_tokens=64)


def question(i: int, run: int) -> list[dict]:
    """Question ``i`` as run ``run`` asks it: a prompt no other run asks."""
    return messages(f"{QUESTIONS[i % len(QUESTIONS)]} Explain it to "
                    f"{AUDIENCES[run % len(AUDIENCES)]}.")


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
            "tokens": generated, "text": finals[0].text}


def copied_share(reply: str, source: str) -> float:
    """The share of the reply's non-empty lines that are lines of ``source`` (1.0: every line
    the model wrote was copied from the file; a reply about the code is near 0)."""
    known = {line.strip() for line in source.splitlines()}
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    return sum(line in known for line in lines) / len(lines) if lines else 0.0


def edit(tokens: int, instruction_after: bool = True) -> Workload:
    """The editing workload. ``instruction_after`` False: the wording used until session 14,
    the instruction before the code only (the default model then describes the code)."""
    def one(engine: Engine, r: int) -> dict:
        code = code_file()
        if instruction_after:
            text = (f"Rename restock_{r} to refill_{r} in this file.\n\n```python\n{code}\n```"
                    "\n\nWrite out the whole file with that one change, as code only.")
        else:
            text = (f"Repeat this file exactly, but rename restock_{r} to refill_{r}. "
                    f"Answer with the code only.\n\n```python\n{code}\n```")
        out = run(engine, [messages(text)], SamplingParams(temperature=0.0, max_tokens=tokens))
        out["copied"] = copied_share(out["text"], code)
        return out
    return one


def chat(engine: Engine, r: int) -> dict:
    return run(engine, [question(0, r)], APP_SAMPLING)


def regenerate_x3(engine: Engine, r: int) -> dict:
    ask = question(1, r)
    run(engine, [ask], APP_SAMPLING)  # the reply the user regenerates (not timed)
    return run(engine, [ask], replace(APP_SAMPLING, n=3))


def three_new(engine: Engine, r: int) -> dict:
    return run(engine, [question(2, r)], replace(APP_SAMPLING, n=3))


def eight_chats(engine: Engine, r: int) -> dict:
    return run(engine, [question(i, r) for i in range(8)], APP_SAMPLING)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--edit-tokens", type=int, default=192)
    parser.add_argument("--model", default="default",
                        help="an mlx-lm folder (the GPU run: the default model's q4 copy "
                             "carried to the device, docs/GPU.md); default: the embedded one")
    parser.add_argument("--out", type=Path, default=RESULTS / "speculative.md",
                        help="the report (default: bench/results/speculative.md)")
    parser.add_argument("--workloads", default="edit,edit-before,chat,regenerate,n3,chats8",
                        help="which workloads, comma-separated (default: all six)")
    args = parser.parse_args()
    every = {  # key: (name, run, metric, target)
        "edit": ("edit (1 chat, greedy)", edit(args.edit_tokens), "decode", 2.0),
        "edit-before": ("edit, asked before the code only (1 chat, greedy)",
                        edit(args.edit_tokens, instruction_after=False), "decode", None),
        "chat": ("chat (1 chat, app sampling)", chat, "decode", 0.97),
        "regenerate": ("regenerate x3 after its reply (app sampling)", regenerate_x3,
                       "aggregate", 1.3),
        "n3": ("n = 3, no earlier reply (app sampling)", three_new, "aggregate", 1.3),
        "chats8": ("8 chats (app sampling)", eight_chats, "aggregate", 0.97),
    }
    chosen = args.workloads.split(",")
    unknown = [k for k in chosen if k not in every]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {list(every)}")
    workloads = [every[k] for k in chosen]
    engines = {}
    for on in (False, True):
        engines[on] = Engine(EngineConfig(model=args.model, kv_memory_mib=256,
                                          speculative=on))
        engines[on].start()
        assert engines[on].wait_ready(600), engines[on].load_error
    results: dict[str, dict[bool, list[dict]]] = {w[0]: {False: [], True: []} for w in workloads}
    for _name, one, _, _ in workloads:  # warm-up (run 0): shapes, the template's prefix
        for on in (False, True):
            one(engines[on], 0)
    for r in range(1, args.repeats + 1):
        for name, one, _, _ in workloads:
            for on in (False, True):
                results[name][on].append(one(engines[on], r))
    counters = engines[True].snapshot().counters
    for e in engines.values():
        e.stop()
    rows = []
    for name, _, metric, target in workloads:
        off = [r[metric] for r in results[name][False]]
        on = [r[metric] for r in results[name][True]]
        ratios = [b / a for a, b in zip(off, on)]
        if target is None:
            verdict = "no target (comparison)"
        else:
            verdict = ">= {}x: {}".format(target, "met" if min(ratios) >= target else
                                          "missed" if max(ratios) < target else "inconclusive")
        copied = [r["copied"] for side in (False, True) for r in results[name][side]
                  if "copied" in r]
        if copied:
            name = f"{name}; reply lines copied from the file {min(copied):.0%}-{max(copied):.0%}"
        rows.append(f"| {name} | {metric} tok/s | {statistics.median(off):.1f} "
                    f"({min(off):.1f}-{max(off):.1f}) | {statistics.median(on):.1f} "
                    f"({min(on):.1f}-{max(on):.1f}) | {statistics.median(ratios):.2f}x "
                    f"({min(ratios):.2f}-{max(ratios):.2f}) | {verdict} |")
    device = mx.default_device()
    where = ", ".join([f"model {args.model}" if args.model != "default" else "default model",
                       str(device), *(["OpenBLAS preloaded"] if device == mx.cpu else [])])
    text = "\n".join([
        "# Speculative decoding (issue #28)", "",
        f"`python -m bench.speculative --repeats {args.repeats} --edit-tokens "
        f"{args.edit_tokens} --workloads {args.workloads}` ({where}; {args.repeats} "
        "repeats, off/on interleaved, each run on prompts no earlier run asked; sampled rows "
        "use the app's default sampling; medians with min-max; the ratio is the median of "
        "the per-repeat ratios).", "",
        "| workload | metric | drafts off | drafts on | on / off | target |",
        "| --- | --- | --- | --- | --- | --- |", *rows, "",
        f"Drafting engine's counters at the end: {counters.draft_tokens} draft tokens "
        f"verified, {counters.accepted_draft_tokens} accepted "
        f"({counters.draft_acceptance:.0%}), in {counters.verify_rows} verify rows.", "",
    ])
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
