"""Engine benchmarks: every docs/ARCHITECTURE.md §8 metric the engine owns, side by side.

    ./run.sh bench            (or: python -m bench.engine_bench [--quick] [--repeats N])

Writes bench/results/engine.md (the table) and bench/results/engine.png (the plot).
Baselines are mlx-lm's own: ``batch_generate`` for throughput, and its ``BatchKVCache``
(the real class, driven with the workload's token counts) for memory.

Timed comparisons run each side ``--repeats`` times (at least 3), interleaved A B A B ... so
a slow spell of the machine hits both sides, and report the median with the spread (min-max).
A ratio's spread is that of its per-repeat ratios (the A and B of one repeat ran back to
back); a verdict is given only when the whole spread is on one side of the target, otherwise
the row says "inconclusive". New timed workloads: add a ``Workload`` (named sides) to the list
``timed_workloads`` returns and, if it has a target, a ``Comparison`` to ``comparisons``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm import batch_generate
from mlx_lm.models.cache import BatchKVCache

from bench.workload import SYSTEM_PROMPT, conversation, make_sessions
from engine import Engine, EngineConfig, SamplingParams
from engine.kv.block_table import BlockTable, NoFreeBlocksError
from engine.kv.blocks import BlockAllocator
from engine.models.resolve import load_model

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


# ---- repeated, interleaved measurement ------------------------------------------------------


@dataclass
class Side:
    """One side of a timed comparison: ``run()`` does the work once and returns the metric."""

    label: str
    run: Callable[[], float]


@dataclass
class Workload:
    """A timed measurement with its sides (e.g. PagedChat and mlx-lm), run interleaved."""

    name: str
    sides: list[Side]


@dataclass(frozen=True)
class Spread:
    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    def fmt(self, spec: str = ".1f", scale: float = 1.0, unit: str = "") -> str:
        m, lo, hi = (x * scale for x in (self.median, self.lo, self.hi))
        return f"{m:{spec}}{unit} ({lo:{spec}}–{hi:{spec}})"


def run_interleaved(workloads: list[Workload], repeats: int,
                    log: Callable[[str], None] = print) -> dict[tuple[str, str], Spread]:
    """Run every side of every workload ``repeats`` times: repeat r runs A then B of each
    workload before repeat r + 1 starts (A B A B ...). Returns each side's values."""
    values: dict[tuple[str, str], list[float]] = {
        (w.name, s.label): [] for w in workloads for s in w.sides}
    for r in range(repeats):
        for w in workloads:
            for side in w.sides:
                values[(w.name, side.label)].append(side.run())
        log(f"repeat {r + 1}/{repeats} done")
    return {k: Spread(tuple(v)) for k, v in values.items()}


def ratio_spread(a: Spread, b: Spread) -> Spread:
    """Per-repeat ratios a_i / b_i (the two ran back to back in repeat i)."""
    return Spread(tuple(x / y for x, y in zip(a.values, b.values, strict=True)))


def verdict(ratio: Spread, target: float | None, higher_is_better: bool = True) -> str:
    """'met' / 'not met' only when every repeat agrees; 'inconclusive' when the spread of the
    per-repeat ratios straddles the target; for rows without a target, whether the two sides'
    difference lies outside the spread (ratio always above or always below 1)."""
    if target is None:
        if ratio.lo > 1.0:
            return "A > B in every repeat"
        if ratio.hi < 1.0:
            return "A < B in every repeat"
        return "no clear difference (within the spread)"
    ok_all = ratio.lo >= target if higher_is_better else ratio.hi <= target
    bad_all = ratio.hi < target if higher_is_better else ratio.lo > target
    if ok_all:
        return "met"
    if bad_all:
        return "**not met**"
    return "inconclusive (spread spans the target)"


@dataclass
class Comparison:
    """A table row: ``a / b`` per repeat against an optional target."""

    label: str
    a: tuple[str, str]  # (workload name, side label)
    b: tuple[str, str]
    target: float | None = None
    higher_is_better: bool = True
    unit_scale: float = 1.0
    unit: str = ""
    spec: str = ".1f"

    def row(self, results: dict[tuple[str, str], Spread]) -> str:
        a, b = results[self.a], results[self.b]
        ratio = ratio_spread(a, b)
        op = ">=" if self.higher_is_better else "<="
        target = f"{op} {self.target:g}x" if self.target is not None else ""
        return (f"| {self.label} | {a.fmt(self.spec, self.unit_scale, self.unit)} | "
                f"{b.fmt(self.spec, self.unit_scale, self.unit)} ({self.b[1]}) | "
                f"{ratio.fmt('.2f')}x | {target} | "
                f"{verdict(ratio, self.target, self.higher_is_better)} |")


# ---- timed sides ----------------------------------------------------------------------------

_RUNS = itertools.count()


def fresh_prompts(engine: Engine, n: int) -> list[list[int]]:
    """The throughput prompts, with a tag at the very start that differs on every call, so the
    prefix cache never turns a repeat into a cheaper run."""
    run = next(_RUNS)
    return [engine.encode_chat(conversation(f"Run {run}. {SYSTEM_PROMPT}", [s.turns[0]], []))
            for s in make_sessions(n, 1)]


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


def _joiner(tag: str) -> list[dict]:
    return [{"role": "system", "content": f"Session {tag}. {SYSTEM_PROMPT}"},
            {"role": "user", "content": "Explain how a rainbow forms."}]


def ttft_alone(engine: Engine) -> float:
    """Time to first token of a chat on an idle engine (a system prompt seen only once)."""
    final = engine.submit(messages=_joiner(f"alone {next(_RUNS)}"), params=SamplingParams(
        temperature=0.0, max_tokens=4), session_id="ttft-alone").result()[0]
    return final.usage.time_to_first_token_s


def ttft_joining(engine: Engine, max_tokens: int) -> float:
    """Time to first token of the same-sized chat joining 7 streaming chats."""
    runners = [engine.submit(messages=conversation(SYSTEM_PROMPT, [f"Tell me fact {i}."], []),
                             params=SamplingParams(temperature=0.7, max_tokens=max_tokens,
                                                   seed=i), session_id=f"ttft-run-{i}")
               for i in range(7)]
    while not all(h.token_events >= 2 or h.done for h in runners):
        time.sleep(0.01)  # polling other threads' progress in a benchmark, not a test
    joined = engine.submit(messages=_joiner(f"join {next(_RUNS)}"), params=SamplingParams(
        temperature=0.0, max_tokens=4), session_id="ttft-joiner").result()[0]
    for h in runners:
        h.cancel()
        h.result()
    return joined.usage.time_to_first_token_s


CHAT_COUNTS = (1, 2, 4, 8)
ENGINE, MLX = "PagedChat", "batch_generate"
TTFT = "first token"


def tp_name(n: int) -> str:
    return f"aggregate tokens/s, {n} chat{'s' if n > 1 else ''}"


def timed_workloads(engine: Engine, reference, tp_tokens: int) -> list[Workload]:
    """The timed comparisons, in the order each repeat runs them."""
    workloads = []
    for n in CHAT_COUNTS:
        def both(n=n) -> list[Side]:
            shared: dict[str, list[list[int]]] = {}

            def engine_side() -> float:
                shared["prompts"] = fresh_prompts(engine, n)  # B reuses A's prompts
                return engine_throughput(engine, shared["prompts"], tp_tokens)

            return [Side(ENGINE, engine_side),
                    Side(MLX, lambda: mlx_lm_throughput(reference, shared["prompts"], tp_tokens))]
        workloads.append(Workload(tp_name(n), both()))
    workloads.append(Workload(TTFT, [
        Side("joining 7 streaming chats", lambda: ttft_joining(engine, max_tokens=200)),
        Side("alone", lambda: ttft_alone(engine)),
    ]))
    return workloads


def comparisons() -> list[Comparison]:
    rows = [Comparison(tp_name(n), (tp_name(n), ENGINE), (tp_name(n), MLX),
                       target=1.3 if n == 8 else None) for n in CHAT_COUNTS]
    rows.append(Comparison("tokens/s at 8 chats / at 1 chat (PagedChat)",
                           (tp_name(8), ENGINE), (tp_name(1), ENGINE), target=5.0))
    rows.append(Comparison("tokens/s at 8 chats / at 1 chat (mlx-lm, for reference)",
                           (tp_name(8), MLX), (tp_name(1), MLX)))
    rows.append(Comparison("first token joining 7 streaming chats / alone",
                           (TTFT, "joining 7 streaming chats"), (TTFT, "alone"), target=2.0,
                           higher_is_better=False, unit_scale=1e3, unit=" ms", spec=".0f"))
    return rows


def plot(results: dict[tuple[str, str], Spread], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for side, style, label in ((ENGINE, "o-", "PagedChat engine (paged pool)"),
                               (MLX, "s--", "mlx-lm batch_generate")):
        spreads = [results[(tp_name(n), side)] for n in CHAT_COUNTS]
        med = [s.median for s in spreads]
        err = [[m - s.lo for m, s in zip(med, spreads)], [s.hi - m for m, s in zip(med, spreads)]]
        ax.errorbar(CHAT_COUNTS, med, yerr=err, fmt=style, capsize=3, label=label)
    ax.set_xlabel("concurrent chats")
    ax.set_ylabel("aggregate tokens/s (median, min-max)")
    ax.set_xticks(CHAT_COUNTS)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Throughput, SmolLM2-135M, same prompts, greedy")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description="PagedChat engine benchmarks")
    parser.add_argument("--quick", action="store_true", help="smaller workload (smoke run)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved runs of each timed side (at least 3 for a verdict)")
    parser.add_argument("--kv-memory-mib", type=float, default=64.0)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    sessions, turns, reply = (3, 2, 16) if args.quick else (8, 3, 48)
    tp_tokens = 12 if args.quick else 64
    RESULTS.mkdir(parents=True, exist_ok=True)

    engine = Engine(EngineConfig(kv_memory_mib=args.kv_memory_mib, block_size=BLOCK_SIZE))
    engine.start()
    if not engine.wait_ready():
        raise SystemExit(f"engine failed to load: {engine.load_error}")
    info = engine.model_info
    reference = load_model("default")  # mlx-lm's side; runs only while the engine is idle
    t0 = time.perf_counter()
    workload = run_multichat(engine, sessions, turns, reply)
    paged_waste = statistics.fmean(workload.waste_samples)
    contiguous_waste = batchkv_waste(workload.turns, batch=sessions)
    fit_paged, fit_contiguous = chats_that_fit(workload.final_conversations, info.num_blocks)
    prompt_blocks, shared, used = compare_panes_sharing(engine)

    workloads = timed_workloads(engine, reference, tp_tokens)
    for w in workloads:  # warm-up (compilation, first allocations): not recorded
        for side in w.sides:
            side.run()
    results = run_interleaved(workloads, args.repeats)
    counters = engine.snapshot().counters
    schedule_share = counters.schedule_time_ms / max(counters.step_time_ms, 1e-9)
    engine.stop()
    elapsed = time.perf_counter() - t0

    def threshold(ok: bool) -> str:
        return "met" if ok else "**not met**"

    lines = [
        f"Model {info.name}, KV pool {info.num_blocks} blocks x {info.block_size} slots "
        f"({args.kv_memory_mib:g} MiB), attention: {info.attention}. Workload: {sessions} "
        f"sessions x {turns} turns, shared system prompt, replies <= {reply} tokens; "
        f"throughput replies {tp_tokens} tokens. Timed rows: median (min–max) of "
        f"{args.repeats} interleaved repeats; the ratio is per repeat; a verdict only when "
        f"every repeat agrees. Run took {elapsed:.0f} s.",
        "",
        "| metric | PagedChat (A) | baseline (B) | ratio A/B | target | verdict |",
        "| --- | ---: | ---: | ---: | --- | --- |",
        f"| KV memory waste, time-averaged (one run) | {paged_waste:.1%} | "
        f"{contiguous_waste:.1%} (BatchKVCache) | | <= 3% | {threshold(paged_waste <= 0.03)} |",
        f"| chats fitting the same KV budget (exact count) | {fit_paged} | {fit_contiguous} "
        f"(BatchKVCache) | {fit_paged / max(fit_contiguous, 1):.2f}x | >= 3x | "
        f"{threshold(fit_paged >= 3 * fit_contiguous)} |",
    ]
    lines += [c.row(results) for c in comparisons()]
    lines += [
        f"| scheduler + allocator share of a step (whole run) | {schedule_share:.2%} | | | "
        f"<= 2% | {threshold(schedule_share <= 0.02)} |",
        f"| compare panes (3) sharing a prompt (exact count) | {prompt_blocks} prompt blocks, "
        f"{shared} held by all 3, {used} used | {3 * prompt_blocks} (3 copies) | | stored once | "
        f"{threshold(shared >= prompt_blocks)} |",
    ]
    if args.repeats < 3:
        lines.append("")
        lines.append(f"Only {args.repeats} repeat(s): too few to trust a verdict (use >= 3).")
    report = "\n".join(lines)
    (RESULTS / "engine.md").write_text(report + "\n")
    plot(results, RESULTS / "engine.png")
    print(report)
    return report


if __name__ == "__main__":
    main()
