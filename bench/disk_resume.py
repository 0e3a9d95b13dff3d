"""The disk tier on the CPU with the default model (issue #27's targets).

    python -m bench.disk_resume [--quick] [--repeats N]   (full sizes: bench/results/disk_resume.md)

1. **Resume after a restart.** A ~4k-token chat is prefilled once by an engine with the disk
   tier on, which writes its blocks before it stops. Then, repeated and interleaved (A B A B):
   A, a fresh engine without the tier prefills the whole chat (the first token of the next
   reply after a restart today); B, a fresh engine on the same cache folder (a restart)
   reads the chat's blocks back and prefills only the rest. Reported: time to the first
   token of each (the engine's own ``Usage.time_to_first_token_s``: from submit to the
   first token, model load excluded), their per-repeat ratio (target <= 0.1x), and whether
   both replies are the same greedy tokens.
2. **Writing never stalls the engine.** Four chats with distinct ~600-token prompts reply
   at once (greedy), on an engine without the tier (A) and with it on an empty folder (B),
   where every full block is copied off and written while the steps run. Reported: step
   times (p50, p99: every ``StepRunner.step`` timed) per side and the ratio of p99s
   (target <= 1.2x), and how many blocks B wrote.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.engine_bench import Spread, ratio_spread, verdict
from bench.mixed_bench import document
from engine import Engine, EngineConfig, FinalEvent, SamplingParams, TokenEvent

RESULT = Path(__file__).parent / "results" / "disk_resume.md"
KV_MIB = 320.0


def start(folder: Path | None) -> Engine:
    engine = Engine(EngineConfig(model="default", kv_memory_mib=KV_MIB, max_batch=8,
                                 disk_cache_dir=None if folder is None else str(folder)))
    engine.start()
    if not engine.wait_ready(900):
        raise SystemExit(f"the default model did not load: {engine.load_error}")
    return engine


def reply(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], FinalEvent]:
    handle = engine.submit(prompt_tokens=prompt,
                           params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens: list[int] = []
    final = None
    for event in handle:
        if isinstance(event, TokenEvent):
            tokens.extend(event.token_ids)
        else:
            final = event
    return tokens, final


def resume(prompt: list[int], folder: Path, repeats: int, log) -> dict:
    engine = start(folder)
    _, warm = reply(engine, prompt, 8)
    t0 = time.perf_counter()
    engine.stop()  # writes the open chat's blocks that are not on disk yet
    flush_s = time.perf_counter() - t0
    written = engine.snapshot().disk
    full, restored, same, disk_tokens = [], [], [], []
    for r in range(repeats):
        engine = start(None)
        a_tokens, a = reply(engine, prompt, 8)
        engine.stop()
        engine = start(folder)
        b_tokens, b = reply(engine, prompt, 8)
        engine.stop()
        full.append(a.usage.time_to_first_token_s)
        restored.append(b.usage.time_to_first_token_s)
        disk_tokens.append(b.usage.disk_prompt_tokens)
        same.append(a_tokens == b_tokens)
        log(f"resume repeat {r + 1}/{repeats}: full {full[-1]:.2f} s, from disk "
            f"{restored[-1]:.3f} s ({disk_tokens[-1]} prompt tokens read back)")
    return {"warm_ttft": warm.usage.time_to_first_token_s, "flush_s": flush_s,
            "written": written, "full": Spread(tuple(full)),
            "restored": Spread(tuple(restored)), "same": same, "disk_tokens": disk_tokens}


def timed(calls: list[float], fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        result = fn(*args, **kwargs)
        calls.append(time.perf_counter() - t)
        return result
    return wrapper


def step_times(folder: Path | None, prompts: list[list[int]], max_tokens: int
               ) -> tuple[list[float], int, list[float]]:
    """Every step's wall time while ``prompts`` reply at once; the blocks written; and the
    time of each copy-off in a step (the engine thread's share of writing)."""
    engine = start(folder)
    stepper = engine.runtime.stepper
    times: list[float] = []
    copies: list[float] = []
    stepper.step = timed(times, stepper.step)  # the engine loop calls rt.stepper.step()
    if stepper.disk is not None:
        stepper.disk.write_through = timed(copies, stepper.disk.write_through)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    handles = [engine.submit(prompt_tokens=p, params=params, session_id=f"chat-{i}")
               for i, p in enumerate(prompts)]
    for handle in handles:
        for _ in handle:
            pass
    engine.stop()
    snap = engine.snapshot()  # stop() publishes the state it ends in
    return times, (snap.disk.writes if snap.disk is not None else 0), copies


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    chat_tokens, step_prompt, step_new = (600, 150, 8) if args.quick else (4000, 600, 32)
    log = print
    tmp = Path(tempfile.mkdtemp(prefix="pagedchat-disk-bench-"))
    try:
        probe = start(None)
        count = lambda text: len(probe.encode(text))  # noqa: E731
        chat = probe.encode_chat([{"role": "user", "content": document(chat_tokens, count)
                                   + "\n\nWhich district received the most crates?"}])
        step_prompts = [
            [probe.encode_chat([{"role": "user", "content": f"(chat {i}, run {r})\n"
                                 + document(step_prompt, count) + "\n\nSummarise."}])
             for i in range(4)] for r in range(2 * args.repeats)]
        probe.stop()
        log(f"chat of {len(chat)} tokens; step-time prompts of {len(step_prompts[0][0])}")
        res = resume(chat, tmp / "resume", args.repeats, log)
        p99s: dict[str, list[float]] = {"off": [], "on": []}
        p50s: dict[str, list[float]] = {"off": [], "on": []}
        writes, copy_ms = [], []
        for r in range(args.repeats):
            for side in ("off", "on"):
                folder = None if side == "off" else tmp / f"steps-{r}"
                prompts = step_prompts[2 * r + (side == "on")]
                times, wrote, copies = step_times(folder, prompts, step_new)
                p99s[side].append(p99(times))
                p50s[side].append(statistics.median(times))
                if side == "on":
                    writes.append(wrote)
                    copy_ms.extend(c * 1e3 for c in copies)
                log(f"steps repeat {r + 1}/{args.repeats} {side}: {len(times)} steps, p50 "
                    f"{p50s[side][-1] * 1e3:.0f} ms, p99 {p99s[side][-1] * 1e3:.0f} ms"
                    + (f", {wrote} blocks written" if side == "on" else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = report(args, len(chat), res, p50s, p99s, writes, copy_ms)
    if not args.quick:
        RESULT.write_text(text)
    print(text)
    return text


def report(args, chat_len: int, res: dict, p50s, p99s, writes, copy_ms) -> str:
    ratio = ratio_spread(res["restored"], res["full"])
    on, off = Spread(tuple(p99s["on"])), Spread(tuple(p99s["off"]))
    step_ratio = ratio_spread(on, off)
    w = res["written"]
    lines = [
        "# The disk tier: resume after a restart, and step times while writing (CPU)",
        "",
        f"`python -m bench.disk_resume --repeats {args.repeats}`"
        + (" --quick" if args.quick else "") + " (after `source scripts/env.sh`), the "
        "default model (SmolLM2-135M, fp32 pool on the CPU), block size 16, on a shared "
        "2-core machine. Medians with the spread (min–max) over interleaved repeats (A B A B).",
        "",
        "## Resume: first token of the next reply after a restart",
        "",
        f"A {chat_len}-token chat. Writing it (the warm run, with the tier on): first token "
        f"{res['warm_ttft']:.2f} s; {w.writes} blocks ({w.bytes / 2**20:.0f} MiB) written, "
        f"{res['flush_s']:.2f} s spent in `stop()` writing what was left.",
        "",
        "| side | time to first token |",
        "| --- | --- |",
        f"| A: full prefill (fresh engine, no disk tier) | {res['full'].fmt('.2f', unit=' s')} |",
        f"| B: restart on the cache folder (blocks read back) | "
        f"{res['restored'].fmt('.3f', unit=' s')} |",
        f"| B / A (target <= 0.1x) | {ratio.fmt('.3f', unit='x')}: "
        f"{verdict(ratio, 0.1, higher_is_better=False)} |",
        "",
        f"Prompt tokens read back per repeat: {res['disk_tokens']}; the same greedy reply "
        f"(8 tokens) in A and B: {res['same']}.",
        "",
        "## Step times with the writer busy",
        "",
        "Four chats, distinct prompts, 32 greedy tokens each, all at once.",
        "",
        "| side | step p50 | step p99 |",
        "| --- | --- | --- |",
        f"| A: no disk tier | {Spread(tuple(p50s['off'])).fmt('.0f', 1e3, ' ms')} | "
        f"{off.fmt('.0f', 1e3, ' ms')} |",
        f"| B: disk tier writing every full block | "
        f"{Spread(tuple(p50s['on'])).fmt('.0f', 1e3, ' ms')} | {on.fmt('.0f', 1e3, ' ms')} |",
        f"| B / A p99 (target <= 1.2x) | | {step_ratio.fmt('.2f', unit='x')}: "
        f"{verdict(step_ratio, 1.2, higher_is_better=False)} |",
        "",
        f"Blocks written during B's runs: {writes}. The engine thread's share of writing, "
        f"copying blocks off the pool for the writer thread (`DiskSync.write_through`, "
        f"{len(copy_ms)} calls, one a step): median {statistics.median(copy_ms):.2f} ms, "
        f"p99 {p99(copy_ms):.2f} ms, max {max(copy_ms):.2f} ms.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
