"""Scheduler decisions, without a model: the step plans it makes on a real allocator."""

from __future__ import annotations

from engine.config import SamplingParams
from engine.events import SequenceState
from engine.kv.blocks import BlockAllocator
from engine.kv.invariants import check_invariants
from engine.sched.scheduler import Scheduler, StepPlan
from engine.sched.sequence import Request, Sequence


def make_seq(tokens: list[int], session: str = "s") -> Sequence:
    request = Request(f"r-{session}", session, SamplingParams(temperature=0.0), list(tokens),
                      handle=None)
    seq = Sequence(request=request, index=0, tokens=list(tokens), num_prompt=len(tokens),
                   key=None, detokenizer=None)
    request.sequences.append(seq)
    return seq


def run(scheduler: Scheduler, plan: StepPlan, next_token: int = 1) -> None:
    """What the engine does after the forward: commit, then append sampled tokens."""
    scheduler.commit(plan)
    for work in plan.works:
        if work.want_logits:
            work.seq.tokens.append(next_token)


def test_long_prompt_is_split_into_budgeted_chunks_and_decoders_keep_running() -> None:
    sched = Scheduler(BlockAllocator(64, 4), max_batch=8, prefill_chunk=8)
    short = make_seq(list(range(3)), "short")
    sched.add(short)
    run(sched, sched.schedule())
    assert short.state is SequenceState.DECODING
    long = make_seq(list(range(100, 130)), "long")
    sched.add(long)
    chunks = []
    while long.state is not SequenceState.DECODING:
        plan = sched.schedule()
        by_seq = {w.seq.session_id: w for w in plan.works}
        assert len(by_seq["short"].tokens) == 1  # the running chat decodes every step
        chunks.append(len(by_seq["long"].tokens))
        run(sched, plan)
    assert chunks == [8, 8, 8, 6]
    check_invariants(sched.alloc, [s.table for s in sched.running.values()])


def test_exhausted_pool_preempts_the_latest_admitted_and_keeps_its_tokens() -> None:
    sched = Scheduler(BlockAllocator(4, 4), max_batch=8, prefill_chunk=64)
    first, second = make_seq([1, 2, 3, 4, 5, 6, 7], "a"), make_seq([9, 8, 7, 6, 5, 4, 3], "b")
    sched.add(first)
    sched.add(second)
    run(sched, sched.schedule())  # both admitted: 2 blocks each, pool full
    assert {s.session_id for s in sched.running.values()} == {"a", "b"}
    run(sched, sched.schedule())  # each fills its second block
    plan = sched.schedule()  # "a" needs a third block: "b" (admitted last) is preempted
    assert [s.session_id for s in plan.preempted] == ["b"]
    assert second.state is SequenceState.PREEMPTED and second.table is None
    assert second.tokens == [9, 8, 7, 6, 5, 4, 3, 1, 1]
    assert next(iter(sched.waiting.values())) is second  # first in the queue
    assert [w.seq.session_id for w in plan.works] == ["a"]
    assert sched.preemptions == 1
    check_invariants(sched.alloc, [s.table for s in sched.running.values()])


def test_identical_prompts_arriving_together_compute_their_prefix_once() -> None:
    alloc = BlockAllocator(32, 4)
    sched = Scheduler(alloc, max_batch=8, prefill_chunk=64)
    prompt = list(range(10, 23))
    panes = [make_seq(prompt, f"pane{i}") for i in range(3)]
    for seq in panes:
        sched.add(seq)
    plan = sched.schedule()
    assert [w.seq.session_id for w in plan.works] == ["pane0"]  # the others wait one step
    run(sched, plan)
    plan = sched.schedule()
    joined = {w.seq.session_id: w for w in plan.works if w.seq.session_id != "pane0"}
    assert set(joined) == {"pane1", "pane2"}
    assert all(w.start == 12 for w in joined.values())  # three full blocks reused
    shared = set(panes[0].table.blocks[:3])
    assert all(set(s.table.blocks[:3]) == shared for s in panes)
    assert all(alloc.refcount(b) == 3 for b in shared)


def test_sequence_larger_than_the_pool_fails_instead_of_looping() -> None:
    sched = Scheduler(BlockAllocator(2, 4), max_batch=8, prefill_chunk=64)
    seq = make_seq(list(range(12)))
    sched.add(seq)
    plan = sched.schedule()
    assert [s for s, _ in plan.failed] == [seq]
    assert "KV memory budget" in plan.failed[0][1]
    assert not sched.has_work


def test_batch_limit_leaves_the_rest_waiting_in_order() -> None:
    sched = Scheduler(BlockAllocator(64, 4), max_batch=2, prefill_chunk=64)
    seqs = [make_seq([i, i + 1, i + 2], f"s{i}") for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    plan = sched.schedule()
    assert [w.seq for w in plan.works] == seqs[:2]
    assert list(sched.waiting.values()) == seqs[2:]


def test_short_prompt_arriving_during_a_long_one_is_admitted_at_once_and_finishes_first() -> None:
    sched = Scheduler(BlockAllocator(128, 4), max_batch=8, prefill_chunk=8)
    long = make_seq(list(range(100, 180)), "long")
    sched.add(long)
    run(sched, sched.schedule())
    short = make_seq([1, 2, 3, 4, 5, 6], "short")
    sched.add(short)
    steps_to_first_token = 0
    long_progress = []
    while short.state is not SequenceState.DECODING:
        before = long.num_in_table
        plan = sched.schedule()
        run(sched, plan)
        long_progress.append(long.num_in_table - before)
        steps_to_first_token += 1
    assert steps_to_first_token == 2  # half the budget on admission, then the rest
    assert long.state is SequenceState.PREFILLING  # the short one did not wait for it
    assert all(n >= 4 for n in long_progress)  # the long prompt still advanced every step
    check_invariants(sched.alloc, [s.table for s in sched.running.values()])


def test_a_token_in_flight_is_fed_as_pending_and_resolved_when_read() -> None:
    from engine.kv.block_table import PENDING

    sched = Scheduler(BlockAllocator(16, 4), max_batch=8, prefill_chunk=64)
    seq = make_seq([1, 2, 3], "s")
    seq.request.params = SamplingParams(temperature=0.0, max_tokens=2)
    sched.add(seq)
    sched.commit(sched.schedule())
    seq.inflight = True  # its first token was sampled, not read yet
    plan = sched.schedule()
    assert [w.tokens for w in plan.works] == [[PENDING]] and plan.works[0].start == 3
    sched.commit(plan)
    sched.resolve(seq, 7)  # step 1's token is read while step 2 runs
    seq.tokens.append(7)
    assert seq.table.tokens == [1, 2, 3, 7] and not seq.inflight
    check_invariants(sched.alloc, [seq.table])
    assert sched.alloc.block_state()[4][seq.table.blocks[0]] == (1, 2, 3, 7)
    seq.inflight = True  # step 2's token is in flight: the reply's last (max_tokens=2)
    assert sched.schedule().works == []  # nothing is computed past the last token
