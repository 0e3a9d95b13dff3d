"""Engine benchmarks: every ARCHITECTURE.md section 8 metric the engine owns, side by side.

    ./run.sh bench            (or: python -m bench.engine_bench [--quick])

Writes bench/results/engine.md (the table) and bench/results/engine.png (the plot).
Baselines are mlx-lm's own: ``batch_generate`` for throughput, and its ``BatchKVCache``
(the real class, driven with the workload's token counts) for memory.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm import batch_generate
from mlx_lm.models.cache import BatchKVCache

from bench.workload import SYSTEM_PROMPT, conversation, make_sessions
from engine import Engine, EngineConfig, SamplingParams
from engine.blocks import BlockAllocator, BlockTable, NoFreeBlocksError
from engine.models import load_model

RESULTS = Path(__file__).parent / "results"
BLOCK_SIZE = 16


@dataclass
class Turn:
    prompt_tokens: int
    generated_tokens: int


@dataclass
class WorkloadRun:
    turns: list[Turn] = field(default_factory=list)
    waste_samples: list[float] = field(default_factory=list)
    final_conversations: list[list[int]] = field(default_factory=list)
    schedule_share: float = 0.0


def run_multichat(engine: Engine, sessions: int, turns: int, max_tokens: int) -> WorkloadRun:
    """All sessions chat at once; each sends its next turn when its reply ends. Samples the
    pool's waste from snapshots while it runs."""
    plan = make_sessions(sessions, turns)
    replies: dict[str, list[str]] = {s.session_id: [] for s in plan}
    params = SamplingParams(temperature=0.7, max_tokens=max_tokens, seed=1)
    result = WorkloadRun()
    active = {}
    for s in plan:
        active[s.session_id] = engine.submit(
            messages=conversation(SYSTEM_PROMPT, s.turns, []), params=params,
            session_id=s.session_id)
    by_id = {s.session_id: s for s in plan}
    while active:
        for sid, handle in list(active.items()):
            if not handle.done:
                continue
            final = handle.result()[0]
            result.turns.append(Turn(final.usage.prompt_tokens, final.usage.generated_tokens))
            replies[sid].append(final.text)
            session = by_id[sid]
            if len(replies[sid]) < len(session.turns):
                active[sid] = engine.submit(
                    messages=conversation(SYSTEM_PROMPT, session.turns, replies[sid]),
                    params=params, session_id=sid)
            else:
                del active[sid]
                msgs = conversation(SYSTEM_PROMPT, session.turns, replies[sid][:-1])
                msgs.append({"role": "assistant", "content": replies[sid][-1]})
                result.final_conversations.append(
                    engine.encode_chat(msgs, add_generation_prompt=False))
        snap = engine.snapshot()
        if snap.used_blocks:
            result.waste_samples.append(snap.waste_fraction)
        time.sleep(0.05)  # sampling period of the waste measurement, not synchronisation
    counters = engine.snapshot().counters
    result.schedule_share = counters.schedule_time_ms / max(counters.step_time_ms, 1e-9)
    return result


def batchkv_waste(turns: list[Turn], batch: int) -> float:
    """Time-averaged waste of mlx-lm's BatchKVCache serving the same turns in batches of
    ``batch``: a left-padded rectangle grown in 256-token steps; finished rows filtered."""
    allocated = live = 0
    for start in range(0, len(turns), batch):
        group = turns[start : start + batch]
        longest = max(t.prompt_tokens for t in group)
        cache = BatchKVCache(left_padding=[longest - t.prompt_tokens for t in group])
        cache.update_and_fetch(*(mx.zeros((len(group), 1, longest, 1)),) * 2)
        rows = list(range(len(group)))  # workload indices of the cache's rows, in order
        for step in itertools.count(1):
            still = [r for r in rows if group[r].generated_tokens > step]
            if not still:
                break
            if len(still) < len(rows):
                cache.filter(mx.array([rows.index(r) for r in still]))
                rows = still
            cache.update_and_fetch(*(mx.zeros((len(rows), 1, 1, 1)),) * 2)
            allocated += cache.keys.shape[0] * cache.keys.shape[2]
            live += sum(group[r].prompt_tokens + step for r in rows)
    return 1.0 - live / allocated


def chats_that_fit(conversations: list[list[int]], num_blocks: int) -> tuple[int, int]:
    """How many of the workload's finished conversations fit at once in ``num_blocks``:
    paged (real allocator, prefix sharing) against one BatchKVCache rectangle."""
    alloc = BlockAllocator(num_blocks, BLOCK_SIZE)
    paged = 0
    for tokens in itertools.cycle(conversations):
        table = BlockTable(owner=str(paged))
        cached = alloc.reuse_prefix(table, tokens)
        try:
            alloc.append(table, tokens[cached:])
        except NoFreeBlocksError:
            break
        alloc.mark_computed(table)
        paged += 1
    budget_slots = num_blocks * BLOCK_SIZE
    contiguous = 0
    while True:
        group = [conversations[i % len(conversations)] for i in range(contiguous + 1)]
        longest = max(map(len, group))
        cache = BatchKVCache(left_padding=[longest - len(t) for t in group])
        cache.update_and_fetch(*(mx.zeros((len(group), 1, longest, 1)),) * 2)
        if cache.keys.shape[0] * cache.keys.shape[2] > budget_slots:
            break
        contiguous += 1
    return paged, contiguous


def engine_throughput(engine: Engine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    handles = [engine.submit(prompt_tokens=p, params=params, session_id=f"tp-{i}")
               for i, p in enumerate(prompts)]
    generated = sum(h.result()[0].usage.generated_tokens for h in handles)
    return generated / (time.perf_counter() - start)


def mlx_lm_throughput(loaded, prompts: list[list[int]], max_tokens: int) -> float:
    start = time.perf_counter()
    response = batch_generate(loaded.model, loaded.tokenizer, prompts, max_tokens=max_tokens,
                              return_token_ids=True)
    generated = sum(len(ids) for ids in response.token_ids)
    return generated / (time.perf_counter() - start)


def first_token_ratio(engine: Engine, max_tokens: int) -> tuple[float, float]:
    """Time to first token of a chat joining 7 streaming chats, and of the same-sized chat
    alone (distinct system prompts, so the prefix cache helps neither)."""
    def joiner(tag: str) -> list[dict]:
        return [{"role": "system", "content": f"Session {tag}. {SYSTEM_PROMPT}"},
                {"role": "user", "content": "Explain how a rainbow forms."}]

    alone = engine.submit(messages=joiner("alpha"), params=SamplingParams(
        temperature=0.0, max_tokens=4), session_id="ttft-alone").result()[0]
    runners = [engine.submit(messages=conversation(SYSTEM_PROMPT, [f"Tell me fact {i}."], []),
                             params=SamplingParams(temperature=0.7, max_tokens=max_tokens,
                                                   seed=i), session_id=f"ttft-run-{i}")
               for i in range(7)]
    while not all(h.token_events >= 2 or h.done for h in runners):
        time.sleep(0.01)
    joined = engine.submit(messages=joiner("omega"), params=SamplingParams(
        temperature=0.0, max_tokens=4), session_id="ttft-joiner").result()[0]
    for h in runners:
        h.cancel()
        h.result()
    return joined.usage.time_to_first_token_s, alone.usage.time_to_first_token_s


def compare_panes_sharing(engine: Engine, panes: int = 3) -> tuple[int, int, int]:
    """Send one prompt to ``panes`` chats at once; returns (prompt full blocks, blocks
    shared by all panes, blocks used in all)."""
    messages = conversation(SYSTEM_PROMPT, ["Compare tea and coffee."], [])
    prompt_blocks = (engine.count_tokens(messages) - 1) // BLOCK_SIZE
    handles = [engine.submit(messages=messages, params=SamplingParams(
        temperature=0.8, max_tokens=64, seed=i), session_id=f"pane-{i}") for i in range(panes)]
    while not all(h.token_events >= 4 or h.done for h in handles):
        time.sleep(0.01)
    snap = engine.snapshot()
    shared = sum(1 for r in snap.refcounts if r == panes)
    used = snap.used_blocks
    for h in handles:
        h.cancel()
        h.result()
    return prompt_blocks, shared, used


def plot(rows: list[tuple[int, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    chats = [r[0] for r in rows]
    ax.plot(chats, [r[1] for r in rows], "o-", label="PagedChat engine (paged pool)")
    ax.plot(chats, [r[2] for r in rows], "s--", label="mlx-lm batch_generate")
    ax.set_xlabel("concurrent chats")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_xticks(chats)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Throughput, SmolLM2-135M, same prompts, greedy")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description="PagedChat engine benchmarks")
    parser.add_argument("--quick", action="store_true", help="smaller workload (smoke run)")
    parser.add_argument("--kv-memory-mib", type=float, default=64.0)
    args = parser.parse_args(argv)
    sessions, turns, reply = (4, 2, 24) if args.quick else (8, 3, 48)
    tp_tokens = 24 if args.quick else 64
    RESULTS.mkdir(parents=True, exist_ok=True)

    engine = Engine(EngineConfig(kv_memory_mib=args.kv_memory_mib, block_size=BLOCK_SIZE))
    engine.start()
    if not engine.wait_ready():
        raise SystemExit(f"engine failed to load: {engine.load_error}")
    info = engine.model_info
    t0 = time.perf_counter()
    workload = run_multichat(engine, sessions, turns, reply)
    paged_waste = statistics.fmean(workload.waste_samples)
    contiguous_waste = batchkv_waste(workload.turns, batch=sessions)
    fit_paged, fit_contiguous = chats_that_fit(workload.final_conversations, info.num_blocks)
    prompt_blocks, shared, used = compare_panes_sharing(engine)
    ttft_joined, ttft_alone = first_token_ratio(engine, max_tokens=200)

    prompts = [engine.encode_chat(conversation(SYSTEM_PROMPT, [s.turns[0]], []))
               for s in make_sessions(8, 1)]
    engine_rates = {n: engine_throughput(engine, prompts[:n], tp_tokens) for n in (1, 2, 4, 8)}
    schedule_share = engine.snapshot().counters.schedule_time_ms / max(
        engine.snapshot().counters.step_time_ms, 1e-9)
    engine.stop()
    reference = load_model("default")
    mlx_rates = {n: mlx_lm_throughput(reference, prompts[:n], tp_tokens) for n in (1, 2, 4, 8)}
    elapsed = time.perf_counter() - t0

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    ratio8 = engine_rates[8] / mlx_rates[8]
    scaling = engine_rates[8] / engine_rates[1]
    ttft_ratio = ttft_joined / ttft_alone
    lines = [
        f"Model {info.name}, KV pool {info.num_blocks} blocks x {info.block_size} slots "
        f"({args.kv_memory_mib:g} MiB), attention: {info.attention}. Workload: {sessions} "
        f"sessions x {turns} turns, shared system prompt, replies <= {reply} tokens. "
        f"Run took {elapsed:.0f} s.",
        "",
        "| metric | PagedChat | baseline (mlx-lm) | ratio | target | verdict |",
        "| --- | ---: | ---: | ---: | --- | --- |",
        f"| KV memory waste, time-averaged | {paged_waste:.1%} | {contiguous_waste:.1%} "
        f"(BatchKVCache) | | <= 3% | {verdict(paged_waste <= 0.03)} |",
        f"| chats fitting the same KV budget | {fit_paged} | {fit_contiguous} (BatchKVCache) | "
        f"{fit_paged / max(fit_contiguous, 1):.2f}x | >= 3x | "
        f"{verdict(fit_paged >= 3 * fit_contiguous)} |",
    ]
    for n in (1, 2, 4, 8):
        lines.append(f"| aggregate tokens/s, {n} chat{'s' if n > 1 else ''} | "
                     f"{engine_rates[n]:.1f} | {mlx_rates[n]:.1f} (batch_generate) | "
                     f"{engine_rates[n] / mlx_rates[n]:.2f}x | "
                     f"{'>= 1.3x' if n == 8 else ''} | "
                     f"{verdict(ratio8 >= 1.3) if n == 8 else ''} |")
    lines += [
        f"| tokens/s at 8 chats / at 1 chat | {scaling:.2f}x | "
        f"{mlx_rates[8] / mlx_rates[1]:.2f}x | | >= 5x | {verdict(scaling >= 5)} |",
        f"| scheduler + allocator share of a step | {schedule_share:.2%} | | | <= 2% | "
        f"{verdict(schedule_share <= 0.02)} |",
        f"| compare panes (3) sharing a prompt | {prompt_blocks} prompt blocks, {shared} "
        f"held by all 3, {used} used | {3 * prompt_blocks} (3 copies) | | stored once | "
        f"{verdict(shared >= prompt_blocks)} |",
        f"| first token joining 7 streaming chats / alone | {ttft_joined * 1e3:.0f} ms / "
        f"{ttft_alone * 1e3:.0f} ms | | {ttft_ratio:.2f}x | <= 2x | {verdict(ttft_ratio <= 2)} |",
    ]
    report = "\n".join(lines)
    (RESULTS / "engine.md").write_text(report + "\n")
    plot([(n, engine_rates[n], mlx_rates[n]) for n in (1, 2, 4, 8)], RESULTS / "engine.png")
    print(report)
    return report


if __name__ == "__main__":
    main()
