"""One shape for a step (docs/ARCHITECTURE.md §3.4): schedule -> launch -> finish the step
before. The scheduler decides the forks while planning; the output hands ended sequences
back and the runner releases them in one place, after the step.

The scheduler's half needs no model; the step's half drives a real runtime (the tiny model)
on the test thread, one ``step()`` at a time, and checks every step against the allocator's
invariants and the replies against mlx-lm's greedy generation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.config import EngineConfig, SamplingParams
from engine.events import FinishReason, SequenceState
from engine.handle import RequestHandle
from engine.kv.blocks import BlockAllocator
from engine.kv.invariants import check_invariants
from engine.loading import load_runtime
from engine.requests.admission import admit
from engine.runner.telemetry import Telemetry
from engine.sched.scheduler import Scheduler
from engine.sched.sequence import Request, Sequence
from tests.reference import collect, reference_model
from tests.tiny_model import budget_mib, make_tiny_model, mlx_lm_greedy


def make_request(prompt: list[int], n: int, session: str) -> Request:
    request = Request(f"r-{session}", session, SamplingParams(temperature=0.0, n=n),
                      list(prompt), handle=None)
    for index in range(n):
        request.sequences.append(Sequence(request=request, index=index, tokens=list(prompt),
                                          num_prompt=len(prompt), key=None, detokenizer=None))
    return request


def test_the_scheduler_forks_the_samples_in_the_step_that_ends_their_prompt() -> None:
    sched = Scheduler(BlockAllocator(64, 4), max_batch=8, prefill_chunk=8)
    request = make_request(list(range(1, 15)), n=3, session="forked")  # 14 tokens: 8 + 6
    first, *samples = request.sequences
    single = make_request([40, 41, 42], n=1, session="single").sequences[0]
    sched.add(single)
    plan = sched.schedule()
    assert plan.forks == {} and plan.fanout(plan.works[0]) == [single]  # n = 1 never forks
    sched.commit(plan)
    single.tokens.append(7)

    sched.add(first)
    plan = sched.schedule()
    assert [len(w.tokens) for w in plan.works if w.seq is first] == [8]
    assert plan.forks == {} and not request.forked  # the shared prompt is not done yet
    sched.commit(plan)
    single.tokens.append(7)

    plan = sched.schedule()
    (ending,) = [w for w in plan.works if w.seq is first]
    assert ending.want_logits
    assert plan.forks == {first.seq_id: samples}
    assert plan.fanout(ending) == [first, *samples]
    assert request.forked
    for s in samples:  # they share every block of the prompt, this step's chunk included
        assert s.state is SequenceState.DECODING and s.seq_id in sched.running
        assert s.table.blocks == first.table.blocks and s.tokens == first.tokens
    sched.commit(plan)
    check_invariants(sched.alloc, [s.table for s in sched.running.values()])
    for s in plan.fanout(ending):
        s.tokens.append(9)  # what the runner samples for each of them
    single.tokens.append(7)

    plan = sched.schedule()
    assert plan.forks == {}  # once per request
    assert sorted(w.seq.seq_id for w in plan.works) == sorted(
        s.seq_id for s in [first, *samples, single])
    assert len(plan.copies) == 2  # the shared partial block, copied for two of the three
    sched.commit(plan)
    check_invariants(sched.alloc, [s.table for s in sched.running.values()])


def test_removal_keeps_the_queue_order_and_frees_the_blocks() -> None:
    sched = Scheduler(BlockAllocator(32, 4), max_batch=1, prefill_chunk=64)
    seqs = [make_request([i, i + 1, i + 2], 1, f"s{i}").sequences[0] for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    sched.commit(sched.schedule())  # the first runs, the rest wait (batch of one)
    assert list(sched.running.values()) == seqs[:1]
    sched.remove(seqs[2])
    assert list(sched.waiting.values()) == [seqs[1], seqs[3]]
    sched.remove(seqs[0])
    assert not sched.running and seqs[0].table is None
    check_invariants(sched.alloc, [])  # every block free or cached
    plan = sched.schedule()
    assert [w.seq for w in plan.works] == [seqs[1]]


# ---- the step, on a real runtime ---------------------------------------------------------

BLOCK = 8
#: (prompt length, max_tokens, n): replies ending at different steps, one request forked
WORKLOAD = [(40, 6, 1), (23, 11, 1), (70, 3, 1), (31, 8, 2)]
#: the order of the scheduler's calls in one step: plan, commit, tokens read, releases last
ONE_STEP = re.compile(r"schedule( commit)?( resolve)*( remove)*")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama",
                           reference_model().path)


def prompt_of(length: int, salt: int) -> list[int]:
    return [(89 * i + 37 * salt + 11) % 30000 + 200 for i in range(length)]


@pytest.mark.parametrize("overlap", [True, False])
def test_each_step_plans_launches_then_releases_what_it_ended(tiny: Path, overlap: bool,
                                                               monkeypatch) -> None:
    rt = load_runtime(EngineConfig(model=str(tiny), kv_memory_mib=budget_mib(128, BLOCK),
                                   block_size=BLOCK, prefill_chunk=32, max_batch=16,
                                   overlap=overlap), Telemetry())
    sched, output = rt.scheduler, rt.output
    calls: list[str] = []
    plans = []
    for name in ("schedule", "commit", "resolve", "remove"):
        real = getattr(sched, name)

        def logged(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            result = _real(*args, **kwargs)
            if _name == "schedule":
                plans.append(result)
            return result

        monkeypatch.setattr(sched, name, logged)

    handles, requests = [], []
    for j, (length, max_tokens, n) in enumerate(WORKLOAD):
        params = SamplingParams(temperature=0.0 if n == 1 else 0.8, seed=3, max_tokens=max_tokens,
                                n=n)
        handle = RequestHandle(f"r{j}", f"s{j}", n, lambda h: None)
        request, refusal = admit(f"r{j}", f"s{j}", None, prompt_of(length, j), params, handle,
                                 rt.loaded.tokenizer, rt.max_context)
        assert refusal is None
        output.requests[request.request_id] = request
        sched.add(request.sequences[0])
        handles.append(handle)
        requests.append(request)

    steps = 0
    while sched.has_work:
        calls.clear()
        rt.stepper.step()
        steps += 1
        assert ONE_STEP.fullmatch(" ".join(calls)), calls
        assert output.finished == []  # every sequence the step ended was released by it
        for request in requests:
            for seq in request.sequences:
                if seq.finished:
                    assert seq.seq_id not in sched.running and seq.seq_id not in sched.waiting
                    assert seq.table is None
        check_invariants(sched.alloc, [s.table for s in sched.running.values()])
        assert steps < 200
    rt.stepper.discard_inflight()
    check_invariants(sched.alloc, [])  # every block free or cached

    forked = requests[-1]
    (fork_plan,) = [p for p in plans if p.forks]
    assert fork_plan.forks == {forked.sequences[0].seq_id: forked.sequences[1:]}
    for j, (length, max_tokens, n) in enumerate(WORKLOAD):
        tokens, finals = collect(handles[j])
        assert len(finals) == n
        assert all(f.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                   for f in finals.values())
        if n == 1:
            assert tokens[0] == mlx_lm_greedy(tiny, prompt_of(length, j), max_tokens)


def test_a_cancel_between_steps_gives_its_blocks_back_before_the_next_step(tiny: Path) -> None:
    rt = load_runtime(EngineConfig(model=str(tiny), kv_memory_mib=budget_mib(128, BLOCK),
                                   block_size=BLOCK, prefill_chunk=32, max_batch=16,
                                   overlap=True), Telemetry())
    sched, output = rt.scheduler, rt.output
    handle = RequestHandle("r", "s", 1, lambda h: None)
    request, _ = admit("r", "s", None, prompt_of(30, 0), SamplingParams(max_tokens=50), handle,
                       rt.loaded.tokenizer, rt.max_context)
    output.requests["r"] = request
    sched.add(request.sequences[0])
    for _ in range(3):
        rt.stepper.step()
    seq = request.sequences[0]
    assert seq.table is not None and seq.inflight  # decoding, a token in flight
    output.finish_request(request, FinishReason.CANCELLED)  # as the inbox does
    assert seq.table is not None  # the output frees nothing itself
    rt.stepper.release_finished()  # as the engine loop does after its commands
    assert seq.table is None and not sched.has_work
    check_invariants(sched.alloc, [])
    rt.stepper.discard_inflight()
    _, finals = collect(handle)
    assert finals[0].finish_reason is FinishReason.CANCELLED
