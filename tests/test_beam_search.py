"""Beam search in the engine (docs/ARCHITECTURE.md §3.12), on the real embedded model.

The replies and their scores are compared with a straightforward beam search on mlx-lm's own
model and KV cache (a copied cache per beam, nothing shared: tests/reference.py
``reference_beam_search``), following Hugging Face's ``_beam_search`` (transformers 5.x).
Memory is read from the engine's snapshots, one per step (a hook on the engine thread's
step), and the allocator's invariants are checked after every step of the pruning and
preemption tests.
"""

from __future__ import annotations

import math

import pytest

from engine import Engine, EngineConfig, FinishReason, SamplingParams, SequenceState
from engine.kv.invariants import check_invariants
from tests.reference import (
    chat_prompt,
    collect,
    greedy_reference,
    reference_beam_search,
    reference_model,
    session_blocks,
    wait_until,
)

pytestmark = pytest.mark.model

BLOCK = 16


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def beams(width: int, max_tokens: int, n: int | None = None, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, beam_width=width, n=width if n is None else n,
                          max_tokens=max_tokens, **extra)


@pytest.fixture(scope="module")
def engine():
    eng = Engine(EngineConfig(kv_memory_mib=64, block_size=BLOCK, max_batch=8,
                              prefill_chunk=128, overlap=True))  # the GPU default; the CPU's is off
    eng.start()
    assert eng.wait_ready(600), eng.load_error
    yield eng
    eng.stop()


def assert_equals_reference(engine: Engine, prompt: list[int], params: SamplingParams,
                            session: str) -> None:
    tokens, finals = collect(engine.submit(prompt_tokens=prompt, params=params,
                                           session_id=session))
    expected = reference_beam_search(prompt, params)
    assert sorted(finals) == list(range(params.n))
    for index, (want_tokens, want_score) in enumerate(expected):
        final = finals[index]
        assert tokens[index] == want_tokens, f"beam {index} of width {params.beam_width}"
        assert final.score == pytest.approx(want_score, rel=1e-4), f"score of beam {index}"
        ended = want_tokens[-1] in reference_model().tokenizer.eos_token_ids
        assert final.finish_reason is (FinishReason.STOP if ended else FinishReason.LENGTH)
        assert final.usage.generated_tokens == len(want_tokens)
    scores = [finals[i].score for i in range(params.n)]
    assert scores == sorted(scores, reverse=True), "replies come best first"


# ---- correctness --------------------------------------------------------------------------


def test_width_one_is_greedy_decoding(engine: Engine) -> None:
    prompt = chat_prompt(user("How many legs does a spider have?"))
    tokens, finals = collect(engine.submit(prompt_tokens=prompt, params=beams(1, 24),
                                           session_id="beam-1"))
    assert tokens[0] == greedy_reference(prompt, 24)
    assert finals[0].score is None  # not a beam search: no hypothesis score


@pytest.mark.parametrize("width", [2, 3, 4])
def test_widths_two_to_four_equal_the_reference_beam_search(engine: Engine, width) -> None:
    prompt = chat_prompt(user("What is the capital of France?"))
    assert_equals_reference(engine, prompt, beams(width, 20), f"beam-{width}")


def test_length_penalty_early_stopping_and_fewer_replies_than_beams(engine: Engine) -> None:
    """n < beam_width returns the best n; "never" with a length penalty searches on where
    the default heuristic stops; True stops at the first beam_width hypotheses."""
    prompt = chat_prompt(user("Name three colours of the rainbow."))
    assert_equals_reference(engine, prompt,
                            beams(3, 16, n=2, length_penalty=2.0, early_stopping="never"),
                            "beam-never")
    assert_equals_reference(engine, prompt,
                            beams(2, 16, n=1, length_penalty=0.0, early_stopping=True),
                            "beam-early")


def test_beams_run_beside_other_chats_and_leave_no_block(engine: Engine) -> None:
    """A search batched with a greedy chat: both equal their solo references."""
    prompt = chat_prompt(user("Say hello in Spanish and in German."))
    other = chat_prompt(user("What is 12 times 12?"))
    greedy = engine.submit(prompt_tokens=other,
                           params=SamplingParams(temperature=0.0, max_tokens=24),
                           session_id="beside-greedy")
    assert_equals_reference(engine, prompt, beams(3, 12), "beside-beams")
    tokens, _ = collect(greedy)
    assert tokens[0] == greedy_reference(other, 24)
    wait_until(lambda: engine.snapshot().used_blocks == 0)


# ---- memory: one chat whose blocks fan out ---------------------------------------------------


class StepSnapshots:
    """A snapshot after every step of the engine thread (a hook on its step runner), with
    the longest table of the chat under watch; optionally the allocator's invariants
    checked there too (a failure is kept, not raised on the engine thread)."""

    def __init__(self, engine: Engine, session: str, check: bool = False) -> None:
        self.engine, self.session, self.check = engine, session, check
        self.samples: list[tuple] = []
        self.errors: list[str] = []
        self.preempted_mid_search = False
        runtime = engine.runtime
        self._step = runtime.stepper.step
        runtime.stepper.step = self._hooked

    def _hooked(self) -> None:
        self._step()
        runtime = self.engine.runtime
        self.engine._publish(force=True)
        snap = self.engine.telemetry.snapshot
        mine = [s for r in runtime.output.requests.values() for s in r.sequences
                if r.session_id == self.session]
        if any(s.state is SequenceState.PREEMPTED and s.num_generated for s in mine):
            self.preempted_mid_search = True
        seqs = [s for s in mine if s.table is not None]
        longest = max((s.table.num_tokens for s in seqs), default=0)
        self.samples.append((snap, len(seqs), longest))
        if self.check:
            scheduler = runtime.scheduler
            tables = [s.table for s in [*scheduler.running.values(), *scheduler.waiting.values()]
                      if s.table is not None]
            try:
                check_invariants(runtime.alloc, tables)
            except AssertionError as e:  # pragma: no cover - reported by the test
                self.errors.append(str(e) or repr(e))

    def close(self) -> None:
        self.engine.runtime.stepper.step = self._step


@pytest.mark.slow
def test_a_width_four_search_of_128_tokens_shares_its_blocks(engine: Engine) -> None:
    """The acceptance's bound: during a width-4 search of 128 tokens the pool never holds
    more than 1.3x the blocks of one sequence of the same prompt and 128 tokens, plus one
    partial block per beam; the beams show as one chat whose blocks are shared."""
    prompt = chat_prompt(user("Write a long story about a dragon who learns to bake bread."))
    watch = StepSnapshots(engine, "beam-memory")
    try:
        tokens, finals = collect(engine.submit(prompt_tokens=prompt, params=beams(4, 128, n=1),
                                               session_id="beam-memory"))
    finally:
        watch.close()
    assert finals[0].finish_reason is FinishReason.LENGTH and len(tokens[0]) == 128
    searching = [(snap, longest) for snap, live, longest in watch.samples if live == 4]
    assert len(searching) >= 120, "a snapshot for every step of the search"
    one_sequence = math.ceil((len(prompt) + 128) / BLOCK)
    peak = max(snap.used_blocks for snap, _ in searching)
    assert peak <= 1.3 * one_sequence + 4, (peak, one_sequence)
    fanned = [snap for snap, _ in searching if snap.shared_blocks > 0]
    assert len(fanned) == len(searching), "the beams share their common blocks every step"
    for snap, _ in searching:
        assert set(snap.sessions) >= {"beam-memory"}
        stats = snap.sessions["beam-memory"]
        assert stats.requests == 1 and stats.blocks_held == snap.used_blocks
        assert all(owners in ((), ("beam-memory",)) for owners in snap.owners)
        assert max(snap.refcounts) <= 4 and stats.blocks_shared == snap.shared_blocks
    wait_until(lambda: engine.snapshot().used_blocks == 0)


def test_pruned_beams_free_their_blocks_at_once(engine: Engine) -> None:
    """Every step of a search, the pool holds exactly the blocks of its live beams' tables
    (each once): a pruned beam's blocks are not kept to the end of the search."""
    prompt = chat_prompt(user("Give me a short tip for learning to cook."))
    watch = StepSnapshots(engine, "beam-prune", check=True)
    try:
        collect(engine.submit(prompt_tokens=prompt, params=beams(4, 24),
                              session_id="beam-prune"))
    finally:
        watch.close()
    assert not watch.errors, watch.errors[0]
    searching = [snap for snap, live, _ in watch.samples if live == 4]
    assert searching
    for snap in searching:
        held = snap.sessions["beam-prune"].blocks_held
        assert held == snap.used_blocks
        assert snap.sessions["beam-prune"].tokens_in_context == sum(
            snap.fills[b] * snap.refcounts[b] for b in range(snap.num_blocks)
            if snap.refcounts[b])
    wait_until(lambda: engine.snapshot().used_blocks == 0)


# ---- preemption and cancellation ------------------------------------------------------------


@pytest.mark.slow
def test_preemption_mid_search_keeps_the_invariants_and_the_replies() -> None:
    """On a pool too small for everything at once the search is preempted whole and
    recomputed; its replies still equal the reference, every step keeps the allocator's
    invariants, and the pool ends empty."""
    prompt = chat_prompt(user("What is the capital of France?"))
    # a chat admitted first that grows until the pool is short: the search, admitted
    # after it, is the one preempted, mid-way
    others = [chat_prompt(user("Write a long poem about autumn."))]
    # 720 KiB per block (30 layers x 2 x 3 heads x 64 dims x 4 bytes x 16 slots): 8 blocks
    small = Engine(EngineConfig(kv_memory_mib=8 * 0.703125, block_size=BLOCK, max_batch=8))
    small.start()
    try:
        assert small.wait_ready(600), small.load_error
        assert small.model_info.num_blocks == 8
        watch = StepSnapshots(small, "preempt-beams", check=True)
        greedy = [small.submit(prompt_tokens=p,
                               params=SamplingParams(temperature=0.0, max_tokens=80),
                               session_id=f"preempt-other-{i}") for i, p in enumerate(others)]
        wait_until(lambda: greedy[0].token_events > 0)
        params = beams(3, 20)
        tokens, finals = collect(small.submit(prompt_tokens=prompt, params=params,
                                              session_id="preempt-beams"))
        other_results = [collect(h) for h in greedy]
        wait_until(lambda: not small.runtime.scheduler.has_work)
        watch.close()
        snap = small.snapshot()
        check_invariants(small.runtime.alloc, [])
    finally:
        small.stop()
    assert not watch.errors, watch.errors[0]
    assert watch.preempted_mid_search, "the search was never preempted after its first step"
    assert snap.used_blocks == 0
    expected = reference_beam_search(prompt, params)
    for index, (want, score) in enumerate(expected):
        assert tokens[index] == want and finals[index].score == pytest.approx(score, rel=1e-4)
    for (got, got_finals), p in zip(other_results, others):
        assert got_finals[0].finish_reason is not FinishReason.ERROR, got_finals[0].error
        assert got[0] == greedy_reference(p, 80)


def test_cancel_mid_search_frees_every_beam(engine: Engine) -> None:
    prompt = chat_prompt(user("Explain in detail how a steam engine works."))
    handle = engine.submit(prompt_tokens=prompt, params=beams(4, 200, n=2),
                           session_id="beam-cancel")
    runtime = engine.runtime

    def fanned_out() -> bool:
        snap = engine.snapshot()
        stats = snap.sessions.get("beam-cancel") if snap else None
        return stats is not None and stats.blocks_shared > 0 and stats.tokens_in_context > \
            4 * len(prompt)

    wait_until(fanned_out, timeout=120)
    handle.cancel()
    tokens, finals = collect(handle)
    assert sorted(finals) == [0, 1]
    assert all(f.finish_reason is FinishReason.CANCELLED and f.text == "" for f in
               finals.values())
    assert not tokens, "a cancelled search shows no reply"
    wait_until(lambda: session_blocks(engine, "beam-cancel") == 0)
    wait_until(lambda: engine.snapshot().used_blocks == 0)
    wait_until(lambda: not runtime.scheduler.has_work)
    check_invariants(runtime.alloc, [])


# ---- the door --------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, named", [
    ({"temperature": 0.7}, "temperature"),
    ({"top_p": 0.9}, "top_p"),
    ({"top_k": 40}, "top_k"),
    ({"min_p": 0.1}, "min_p"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"seed": 3}, "seed"),
    ({"logprobs": 2}, "logprobs"),
    ({"stop": ("\n",)}, "stop"),
    ({"n": 4}, "n must be at most beam_width"),
    ({"beam_width": 9}, "beam_width"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"length_penalty": float("nan")}, "length_penalty"),
])
def test_combinations_that_make_no_sense_are_refused_by_name(fields, named) -> None:
    values = {"temperature": 0.0, "beam_width": 3, **fields}
    with pytest.raises(ValueError, match=named):
        SamplingParams(**values)


def test_the_engine_refuses_more_beams_than_its_batch(engine: Engine) -> None:
    assert SamplingParams(beam_width=1, temperature=0.7).num_sequences == 1
    with pytest.raises(ValueError, match="max_batch"):
        Engine(EngineConfig(max_batch=2)).submit(prompt_tokens=[1, 2], params=beams(3, 4))


# ---- without a model: the group's decisions and the scheduler's forks ------------------------


def _beam_request(prompt: list[int], width: int, max_tokens: int = 8, **extra):
    from engine.sched.beams import BeamGroup
    from engine.sched.sequence import Request, Sequence

    params = beams(width, max_tokens, **extra)
    request = Request("r-beams", "beams", params, list(prompt), handle=None)
    for index in range(width):
        request.sequences.append(Sequence(request=request, index=index, tokens=list(prompt),
                                          num_prompt=len(prompt), key=None, detokenizer=None))
    request.beams = BeamGroup(request)
    request.beams.start(request.sequences[0])
    return request


def _run(sched, plan) -> None:
    sched.commit(plan)


def test_forks_share_every_block_and_pruned_beams_give_theirs_back_at_once() -> None:
    from engine.kv.blocks import BlockAllocator
    from engine.sched.scheduler import Scheduler

    eos = {0}
    alloc = BlockAllocator(32, 4)
    sched = Scheduler(alloc, max_batch=8, prefill_chunk=64)
    request = _beam_request([5, 6, 7, 8, 9, 10], width=2)  # a full block and a partial one
    group = request.beams
    first = request.sequences[0]
    sched.add(first)
    _run(sched, sched.schedule())
    # the prompt's row: 11 then 12 are its best tokens; both continuations go on
    assert group.report(first, [(11, -0.1), (12, -0.5), (13, -3.0), (14, -4.0)])
    step = group.select(eos, max_context=100)
    assert not step.done and [(c.token, c.logprob) for c in step.continuations] == [
        (11, -0.1), (12, -0.5)]
    a, b = sched.advance_beams(group, step)
    assert a is first and b is request.sequences[1]
    assert a.table.blocks == b.table.blocks and all(alloc.refcount(x) == 2 for x in a.table.blocks)
    assert (a.tokens[-1], b.tokens[-1]) == (11, 12)
    plan = sched.schedule()  # both extend the shared partial block: one copy, not two
    assert len(plan.copies) == 1
    _run(sched, plan)
    check_invariants(alloc, [a.table, b.table])
    private = a.table.blocks[-1]
    # next step: both best continuations come from b; a is pruned, its private block freed
    assert group.report(a, [(20, -5.0), (21, -6.0), (22, -7.0), (23, -8.0)]) is False
    assert group.report(b, [(30, -0.2), (31, -0.3), (32, -4.0), (33, -5.0)])
    step = group.select(eos, max_context=100)
    assert [c.parent for c in step.continuations] == [b, b]
    used = sum(alloc.refcount(x) > 0 for x in range(32))
    placed = sched.advance_beams(group, step)
    assert placed == [b, a] and alloc.refcount(private) == 0
    assert sum(alloc.refcount(x) > 0 for x in range(32)) == used - 1
    assert a.tokens[-2:] == [12, 31] and b.tokens[-2:] == [12, 30]
    check_invariants(alloc, [a.table, b.table])
    assert group.scores == {b.seq_id: pytest.approx(-0.7), a.seq_id: pytest.approx(-0.8)}


def test_the_group_keeps_finished_hypotheses_and_stops_like_hf() -> None:
    from engine.kv.blocks import BlockAllocator
    from engine.sched.scheduler import Scheduler

    eos = {0}
    sched = Scheduler(BlockAllocator(32, 4), max_batch=8, prefill_chunk=64)
    request = _beam_request([5, 6, 7], width=2, max_tokens=3, early_stopping=True)
    group = request.beams
    first = request.sequences[0]
    sched.add(first)
    _run(sched, sched.schedule())
    # EOS ranks first: a hypothesis of one token; the next two go on
    group.report(first, [(0, -0.1), (11, -0.2), (12, -0.3), (13, -2.0)])
    step = group.select(eos, max_context=100)
    assert [h.tokens for h in group.finished] == [(0,)]
    assert group.finished[0].score == pytest.approx(-0.1) and group.finished[0].ended
    a, b = sched.advance_beams(group, step)
    _run(sched, sched.schedule())
    # an EOS outside the first k candidates is not a hypothesis
    group.report(a, [(14, -0.1), (15, -0.2), (0, -9.0), (16, -9.5)])
    group.report(b, [(0, -0.05), (17, -3.0), (18, -4.0), (19, -5.0)])
    step = group.select(eos, max_context=100)
    # b's EOS (-0.3 - 0.05, over 2 tokens) fills the k hypotheses: True stops there
    assert step.done and [h.tokens for h in group.finished] == [(0,), (12, 0)]
    assert group.finished[1].score == pytest.approx(-0.35 / 2)
