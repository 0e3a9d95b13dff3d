"""The adaptive prompt budget on a simulated step-time model (no model, no clock).

The simulated step costs ``decode`` plus a fixed prefill overhead plus a per-token cost, as
a real chunked prefill does (the overhead is the context gather, growing with the prompt),
and, where the test says so, a per-token cost that grows with the context the token attends
to; the budget never sees those parameters, only the step times (and the prompt's context)
it is told.
"""

from __future__ import annotations

import pytest

from engine.runner.step_batch import bucket, bucket_below
from engine.sched.prefill_budget import MAX_SKIPPED_STEPS, PrefillBudget


def simulate(budget: PrefillBudget, decode: float, overhead: float, per_token: float,
             steps: int) -> list[float]:
    """Step times (relative to a pure decode step) while a long prompt prefills."""
    budget.observe(decode, decode_rows=4, prompt_tokens=0)  # a decode-only step first
    ratios = []
    for _ in range(steps):
        n = budget.budget(decoding=True)
        step = decode + overhead + per_token * n
        budget.observe(step, decode_rows=4, prompt_tokens=n)
        ratios.append(step / decode)
    return ratios


def yielding_paste(budget: PrefillBudget, card, decode: float,
                   free_tokens_used: bool = True) -> tuple[list[int], float]:
    """An 8,000-token paste yielding to a focused chat that decodes beside it, scheduled by
    the real scheduler under ``budget`` on a simulated card (``card(prompt tokens)``: the
    step's seconds): the paste's tokens in each step, and the worst step over ``decode``."""
    from engine.config import Priority
    from engine.events import SequenceState
    from engine.kv.blocks import BlockAllocator
    from engine.sched.scheduler import Scheduler
    from tests.test_scheduler import make_seq, run

    sched = Scheduler(BlockAllocator(1024, 16), max_batch=8, prefill_chunk=256)
    focused = make_seq([1, 2, 3], "focused")
    focused.request.priority = Priority.INTERACTIVE
    sched.add(focused)
    run(sched, sched.schedule())
    paste = make_seq(list(range(8000)), "paste")
    sched.add(paste)
    taken, worst = [], 0.0
    while paste.state is not SequenceState.DECODING:
        context = paste.num_in_table
        n = budget.budget(decoding=True, context=context)
        free = budget.free_tokens if free_tokens_used else 0
        plan = sched.schedule(n, continue_prompts=not budget.holding, free_tokens=free)
        tokens = sum(len(w.tokens) for w in plan.works if w.seq is paste)
        assert any(w.seq is focused for w in plan.works)  # the focused chat decodes
        step = card(tokens)
        budget.observe(step, decode_rows=1, prompt_tokens=tokens,
                       prompt_context=context + tokens / 2)
        run(sched, plan)
        taken.append(tokens)
        worst = max(worst, step / decode)
    return taken, worst


@pytest.mark.parametrize("decode, overhead, per_token", [
    (0.050, 0.002, 0.002),  # CPU-like: a prompt token costs a 25th of a decode step
    (0.010, 0.0005, 0.00002),  # GPU-like: prompt tokens are cheap
    (0.050, 0.010, 0.001),  # a large fixed cost per chunk (long context)
])
def test_steps_settle_at_the_target_multiple_of_a_decode_step(decode, overhead, per_token):
    budget = PrefillBudget(max_chunk=4096, min_chunk=16, target=2.0)
    ratios = simulate(budget, decode, overhead, per_token, steps=30)
    assert all(abs(r - 2.0) < 0.1 for r in ratios[-10:]), ratios
    assert budget.budget(decoding=False) == 4096  # a prompt alone runs at full chunk


def test_a_prompt_too_costly_for_one_step_skips_steps_and_still_advances():
    budget = PrefillBudget(max_chunk=256, min_chunk=16, target=2.0)
    decode, overhead, per_token = 0.05, 0.08, 0.001
    budget.observe(decode, decode_rows=4, prompt_tokens=0)
    taken, ratios = [], []
    for _ in range(40):
        n = budget.budget(decoding=True)
        if budget.holding:  # the prompt under way skips this step (a new one could start)
            n = 0
        step = decode + (overhead + per_token * n if n else 0.0)
        budget.observe(step, decode_rows=4, prompt_tokens=n)
        taken.append(n)
        ratios.append(step / decode)
    late = taken[10:]
    # it runs every other step (two steps' allowance pay for its 0.096 s chunk) ...
    assert all(n >= 16 for n in late[::2] + late[1::2] if n) and late.count(0) >= len(late) // 3
    # ... never skips more than the guaranteed share allows ...
    run = longest = 0
    for n in taken:
        run = run + 1 if n == 0 else 0
        longest = max(longest, run)
    assert longest <= MAX_SKIPPED_STEPS
    # ... and the streaming chats see the target on average
    assert sum(ratios[10:]) / len(ratios[10:]) <= 2.0 + 0.1


def long_paste(context_cost: float, steps: int = 60) -> tuple[list[float], list[int], int]:
    """A paste from 2,000 tokens of context on, beside four decodes (the CPU's profile,
    bench/results/paste.md): a chunk re-reads its context (``context_cost`` seconds per token
    of it) and each of its tokens costs 2 ms; a decode step 50 ms. Returns the step times
    over a decode step, the tokens each step took, and the context reached."""
    budget = PrefillBudget(max_chunk=256, min_chunk=8, target=2.0)
    decode = 0.05
    budget.observe(decode, decode_rows=4, prompt_tokens=0)
    ratios, taken, context = [], [], 2000
    for _ in range(steps):
        n = budget.budget(decoding=True, context=context)
        if budget.holding:
            n = 0
        step = decode + ((context_cost * context + 0.002 * n) if n else 0.0)
        budget.observe(step, decode_rows=4, prompt_tokens=n, prompt_context=context + n / 2)
        context += n
        ratios.append(step / decode)
        taken.append(n)
    return ratios, taken, context


def test_a_banked_chunk_never_passes_the_peak_and_the_prompt_keeps_its_share():
    """Even the smallest chunk costs more than one step's allowance, so the prompt skips
    steps. Spending the whole bank at once made chunks of 15 tokens and steps of 2.4-2.6
    decode steps, growing with the context (the streams' p99); capped at the peak
    (``PEAK_OVER_TARGET`` times the target), the chunks are smaller, the bank keeps what they
    leave, and the prompt advances about as fast, at the target on average."""
    ratios, _, context = long_paste(context_cost=0.00002)
    late = ratios[10:]
    assert max(late) <= 2.4, [round(r, 2) for r in ratios]
    assert sum(late) / len(late) <= 2.0 + 0.05
    assert context - 2000 >= 420  # the uncapped budget took 454 tokens in these 60 steps


def test_a_smallest_chunk_past_the_peak_runs_alone_as_soon_as_the_bank_pays():
    """Twice the context cost: 8 tokens cost 1.9 decode steps of their own, past the peak.
    The prompt then runs its smallest chunk whenever its bank covers it (every other step),
    not after the most steps it may skip (``MAX_SKIPPED_STEPS``, as a first cut did)."""
    _, taken, _ = long_paste(context_cost=0.00004)
    late = taken[10:]
    assert set(late) == {0, 8}, late
    run = longest = 0
    for n in late:
        run = run + 1 if n == 0 else 0
        longest = max(longest, run)
    assert longest == 1 and late.count(8) >= len(late) // 2 - 1, late


def test_the_chunk_follows_its_cost_at_the_context_it_is_read_at():
    """A token at 3,000 tokens of context costs 4x one at 0 (attention over the context). A
    short chat's prompt arrives between the paste's chunks: a cost learned from the short
    prompt's cheap tokens must not make the paste's next chunk overshoot (a single average
    cost per token did: 2.55x a decode step)."""
    budget = PrefillBudget(max_chunk=512, min_chunk=8, target=2.0)
    decode, a, b = 0.05, 0.0005, 0.0005 / 1000
    budget.observe(decode, decode_rows=4, prompt_tokens=0)
    ratios = []
    paste_at = 2000
    for step in range(60):
        short = step % 3 == 2  # every third step a short prompt from context 0
        context = 0 if short else paste_at
        n = budget.budget(decoding=True, context=context)
        mean_context = context + (n - 1) / 2
        cost = n * (a + b * mean_context)
        budget.observe(decode + cost, decode_rows=4, prompt_tokens=n,
                       prompt_context=mean_context)
        if not short:
            paste_at += n
        ratios.append((decode + cost) / decode)
    assert all(r <= 2.0 + 0.1 for r in ratios[6:]), [round(r, 2) for r in ratios]
    assert all(r >= 2.0 - 0.2 for r in ratios[6:])  # and it uses what it is allowed


def test_target_zero_keeps_the_fixed_chunk():
    budget = PrefillBudget(max_chunk=256, min_chunk=16, target=0)
    simulate(budget, decode=0.05, overhead=0.0, per_token=0.01, steps=5)
    assert budget.budget(decoding=True) == 256


def test_a_skipped_step_still_admits_a_new_prompt():
    """While a long paste skips steps (its chunk costs more than a step allows), a short
    chat that arrives is admitted in the very next step, and the paste yields."""
    from engine.config import Priority
    from engine.events import SequenceState
    from engine.kv.blocks import BlockAllocator
    from engine.sched.scheduler import WAIT_YIELD, Scheduler
    from tests.test_scheduler import make_seq, run

    sched = Scheduler(BlockAllocator(512, 16), max_batch=8, prefill_chunk=256)
    chat = make_seq(list(range(1, 4)), "chat")
    sched.add(chat)
    run(sched, sched.schedule())
    paste = make_seq(list(range(2000)), "paste")
    paste.request.priority = Priority.NORMAL
    sched.add(paste)
    run(sched, sched.schedule(64))  # the paste starts (a share: it counts as background)
    started = paste.num_in_table
    assert started > 0
    short = make_seq(list(range(7, 27)), "short")
    sched.add(short)
    plan = sched.schedule(32, continue_prompts=False)
    works = {w.seq.session_id: len(w.tokens) for w in plan.works}
    assert works == {"chat": 1, "short": 20}  # the paste skips, the new chat starts
    assert paste.waiting_reason == WAIT_YIELD and short.state is SequenceState.PREFILLING
    assert paste.num_in_table == started


def test_a_cold_start_does_not_read_a_slope_from_chunks_a_few_tokens_apart():
    """The first chunks of a paste beside a streaming chat sit a few tokens apart, and their
    costs are mostly the steps' noise. A line through them once read 3 ms per token of
    context from contexts 17 and 20, and the paste then skipped every step it could (on a
    loaded machine it never finished prefilling beside one chat). A flat line keeps it
    advancing at the target."""
    budget = PrefillBudget(max_chunk=256, min_chunk=8, target=2.0)
    decode = 0.08
    budget.observe(decode, decode_rows=1, prompt_tokens=0)
    assert budget.budget(decoding=True, context=0) == 8  # cold: start small, learn
    # two noisy chunks: 8 tokens at context ~4 cost 2 ms each, 8 at ~12 cost 6 ms each
    budget.observe(decode + 8 * 0.002, decode_rows=1, prompt_tokens=8, prompt_context=4)
    budget.observe(decode + 8 * 0.006, decode_rows=1, prompt_tokens=8, prompt_context=12)
    assert budget.cost.line()[1] == 0.0
    n = budget.budget(decoding=True, context=16)
    assert not budget.holding and n >= 8
    # what it admits fits the allowance at the mean cost it has seen
    assert n == pytest.approx(decode / budget.cost.line()[0], abs=1)


def launch_bound_step(decode: float, n: int, step: int) -> float:
    """The H200's 1B paste profile (bench/results/gpu.md, raw/gpu_paste_50ca12e.json): up to
    64 prompt tokens ride along with five decodes for free, then 0.14 ms a token; steps
    spread +-12% around their cost (a fixed pattern, no randomness)."""
    noise = (0.88, 1.12, 0.95, 1.05, 1.0)[step % 5]
    return (decode + max(0, n - 64) * 0.00014) * noise


@pytest.mark.parametrize("floor", [None, bucket_below], ids=["any", "bucketed"])
def test_free_chunks_do_not_make_the_next_one_overshoot(floor):
    """On a launch-bound GPU step, 64 prompt tokens cost nothing measurable and more cost
    0.14 ms each. A price per token fitted to the free chunks went flat and the budget
    then admitted 120-170 tokens at a time (steps of 12-21 ms beside a 6.6 ms decode: the
    streams' p99, 3.65x on the H200); on this profile the old budget's steps reached 3.05x
    (and its second chunk took all 512 tokens). With the knee the steps stay within the
    target up to their noise, and the paste still gets its free tokens every step;
    bucketed, every chunk is a bucketed size."""
    decode = 0.0066
    budget = PrefillBudget(max_chunk=512, min_chunk=8, target=2.0, floor=floor)
    for i in range(4):
        budget.observe(launch_bound_step(decode, 0, i), decode_rows=5, prompt_tokens=0)
    taken, ratios = [], []
    context = 0
    for i in range(80):
        n = budget.budget(decoding=True, context=context)
        step = launch_bound_step(decode, n, i)
        budget.observe(step, decode_rows=5, prompt_tokens=n, prompt_context=context + n / 2)
        context += n
        taken.append(n)
        ratios.append(step / decode)
    late = ratios[10:]
    # the issue's bound on the streams' p99 (2.5x), and the target on average
    assert max(late) <= 2.5 and sum(late) / len(late) <= 2.05, [round(r, 2) for r in ratios]
    assert sum(taken[10:]) / len(taken[10:]) >= 64, taken
    if floor is not None:
        assert all(bucket(n) == n for n in taken), taken


def test_bucket_below_is_the_largest_bucket_not_above():
    for n in range(1, 3000):
        below = bucket_below(n)
        assert below <= n and bucket(below) == below
        assert bucket(below + 1) > n or below == n, n


def test_a_steep_price_does_not_lock_the_budget_below_its_free_tokens():
    """H100, session 23 (bench/results/gpu.md, "Why the paste crawls"): a GPU step carries up
    to about 64 prompt tokens for free. A slow step a few tokens past the knee priced each of
    those tokens at the whole step's excess (a steep line), a slow small step dropped the
    knee, and a few slow decode-only steps raised the decode step. The budget then offered a
    bucket the line allowed, every such step was free, a free step never re-prices tokens
    past the knee, and rounding down to a bucket kept the next offer at the same size: the
    paste ran 8-32 tokens a step to its end (half of 8 runs: 2.5-3.4 s against 1.3-1.4).
    The budget must measure the price past the knee again and recover the free tokens,
    within the p99 bound (2.5x)."""
    decode = 0.005
    budget = PrefillBudget(max_chunk=256, min_chunk=8, target=2.0, floor=bucket_below)
    for _ in range(4):
        budget.observe(decode, decode_rows=5, prompt_tokens=0)
    context = 0

    def chunk(step_s: float, n: int) -> None:
        nonlocal context
        budget.observe(step_s, decode_rows=5, prompt_tokens=n, prompt_context=context + n / 2)
        context += n

    for _ in range(20):
        chunk(decode * 1.05, 64)  # free
    for _ in range(4):
        chunk(decode * 1.4, 128)  # the price past 64 tokens, at a low context
    for _ in range(20):
        chunk(decode * 1.05, 96)  # free: the knee is 96
    context = 5300
    chunk(decode + 0.003, 100)  # a slow step 4 tokens past the knee: 0.75 ms a token
    chunk(decode + 0.0024, 8)  # a slow small step: the knee goes
    for _ in range(16):
        budget.observe(0.0079, decode_rows=5, prompt_tokens=0)  # slow decode-only steps

    def card(n: int) -> float:  # up to 64 prompt tokens free, then 0.1 ms a token
        return 0.0062 + max(0, n - 64) * 0.0001

    taken, ratios = [], []
    for _ in range(120):
        n = budget.budget(decoding=True, context=context)
        step = card(n)
        chunk(step, n)
        taken.append(n)
        ratios.append(step / 0.0062)
    assert sum(taken[40:]) / len(taken[40:]) >= 48, taken
    assert max(ratios) <= 2.5, [round(r, 2) for r in ratios]
    assert all(bucket(n) == n for n in taken), taken


@pytest.mark.parametrize("lag", [0, 1], ids=["in-order", "overlapped"])
def test_costly_probes_grow_rare_where_the_price_is_right(lag):
    """Where tokens past a real knee do cost what the line says (64 free, then 0.4 ms a
    token, the line fitted to that), a probe is a step over the target that teaches nothing:
    each costly probe doubles the wait for the next, on an engine that observes a step
    before the next budget (lag 0) and on an overlapped one that asks the next budget first
    (lag 1)."""
    decode = 0.0066
    budget = PrefillBudget(max_chunk=256, min_chunk=8, target=2.0, floor=bucket_below)

    def card(n: int) -> float:
        return decode + max(0, n - 64) * 0.0004

    for _ in range(4):
        budget.observe(decode, decode_rows=5, prompt_tokens=0)
    context, pending, taken = 0, [], []
    for _ in range(400):
        n = budget.budget(decoding=True, context=context)
        pending.append((card(n), n, context + n / 2))
        context += n
        taken.append(n)
        while len(pending) > lag:
            step, m, ctx = pending.pop(0)
            budget.observe(step, decode_rows=5, prompt_tokens=m, prompt_context=ctx)
    steady = max(set(taken[50:]), key=taken[50:].count)
    probes = sum(1 for n in taken[50:] if n > steady)
    assert probes <= 5, (steady, probes, taken)


def test_free_tokens_are_the_knee_or_the_whole_of_a_probe():
    """``free_tokens`` tells the scheduler how much of a step's budget costs the decoding chats
    nothing (a yielding paste may take that much): the knee, all of a probe or of a slow-start
    offer (steps that test for more), and none where every prompt token costs (a CPU)."""
    decode = 0.005
    budget = PrefillBudget(max_chunk=256, min_chunk=8, target=2.0, floor=bucket_below)
    budget.observe(decode, decode_rows=5, prompt_tokens=0)
    assert budget.budget(decoding=True) == 8 and budget.free_tokens == 8  # a test: the least
    budget.observe(decode, decode_rows=5, prompt_tokens=8)
    n = budget.budget(decoding=True)
    assert n == 16 and budget.free_tokens == 16  # the slow start's offer tests 16
    budget.observe(decode * 1.05, decode_rows=5, prompt_tokens=16)
    budget.observe(decode * 1.05, decode_rows=5, prompt_tokens=64)
    budget.observe(decode * 1.6, decode_rows=5, prompt_tokens=128, prompt_context=64)
    free_run = []
    for _ in range(12):  # priced now: offers past the knee are not free
        n = budget.budget(decoding=True, context=200)
        free_run.append(budget.free_tokens)
        assert budget.free_tokens == min(n, 64) or budget.free_tokens == n > 64  # a probe
        budget.observe(decode * 1.05 if n <= 64 else decode * 1.6, decode_rows=5,
                       prompt_tokens=n, prompt_context=200)
    assert 64 in free_run

    cpu = PrefillBudget(max_chunk=256, min_chunk=8, target=2.0)
    cpu.observe(0.1, decode_rows=4, prompt_tokens=0)
    for _ in range(10):
        n = cpu.budget(decoding=True, context=1000)
        cpu.observe(0.1 + n * 0.004, decode_rows=4, prompt_tokens=n, prompt_context=1000)
    cpu.budget(decoding=True, context=1000)
    assert cpu.free_tokens == 0


def test_a_yielding_paste_reads_a_launch_bound_steps_free_tokens():
    """The scheduler and the budget together, on a simulated card where a step carries up to
    128 prompt tokens at a decode step's cost and 0.1 ms a token past that (a decode step of
    6.2 ms, as the 1B shape's on an H100): a paste that yields to the focused chat still
    reads the free tokens each step, so it finishes in close to 8,000 / 128 steps, where the
    background share alone (64) takes twice as many; no step passes the p99 bound (2.5
    decode steps)."""
    decode = 0.0062

    def card(n: int) -> float:
        return decode + max(0, n - 128) * 0.0001

    def paste_steps(free_tokens_used: bool) -> tuple[int, float]:
        budget = PrefillBudget(max_chunk=256, min_chunk=8, target=2.0, floor=bucket_below)
        for _ in range(4):
            budget.observe(decode, decode_rows=1, prompt_tokens=0)
        taken, worst = yielding_paste(budget, card, decode, free_tokens_used)
        return len(taken), worst

    with_free, worst = paste_steps(True)
    share_only, _ = paste_steps(False)
    assert with_free <= 8000 / 128 * 1.25, with_free
    assert share_only >= 8000 / 64 * 0.95, share_only
    assert worst <= 2.5, worst


def test_a_yielding_paste_probes_past_a_knee_its_share_set():
    """A paste reads 256 tokens a step beside four streams at a decode step's cost (a
    launch-bound GPU) until one noisy step at the knee clears the knee. The focused chat's
    question arrives and the paste yields to it: it takes the background share (64), which is
    free, so the knee comes back at 64 and no more. The line's offer (256) stays past the knee,
    and the budget probed only where the offer was at or under the knee: the paste read 64
    tokens a step to its end (found reading session 27's H100 traces, bench/results/gpu.md;
    there the knee stayed at 0 for another reason, a stale decode step, so this lock is the
    one that follows once that is right). A yielding paste must probe past the knee its share
    set and read the free tokens again, no step of the focused chat passing the p99 bound
    (2.5 decode steps)."""
    decode = 0.0105

    def card(n: int) -> float:  # launch-bound: a whole 256-token chunk rides along free
        return decode * 1.03

    budget = PrefillBudget(max_chunk=256, min_chunk=8, target=2.0, floor=bucket_below)
    for _ in range(4):
        budget.observe(decode, decode_rows=4, prompt_tokens=0)
    for i in range(12):  # the paste beside the streams alone: 256 tokens a step, free
        budget.observe(card(256), decode_rows=4, prompt_tokens=256, prompt_context=128 + 256 * i)
    budget.observe(decode * 1.3, decode_rows=4, prompt_tokens=256, prompt_context=3200)
    assert budget.knee == 0  # the noisy step cleared it, and priced the tokens

    taken, worst = yielding_paste(budget, card, decode)
    assert max(taken) == 256, taken  # the free tokens come back
    assert len(taken) <= 8000 / 128, (len(taken), taken)  # at the share alone: 125 steps
    assert worst <= 2.5, worst
