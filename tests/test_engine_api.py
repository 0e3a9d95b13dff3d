"""The engine's public API where the README promises more than test_engine.py checks:
``handle.stream()`` in asyncio, cancelling a waiting or a preempted request, and submit/cancel
from several threads at once. A small pool (16 blocks) and max_batch 2 make requests wait and
get preempted; every finished reply is still compared with mlx-lm's own greedy generation.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import Engine, EngineConfig, FinalEvent, FinishReason, SamplingParams, TokenEvent
from engine.events import SequenceState
from tests.reference import chat_prompt, collect, greedy_reference, wait_until

pytestmark = pytest.mark.model

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain what a KV cache is in one sentence.",
    "Give me a short tip for learning to cook.",
]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


@pytest.fixture(scope="module")
def engine():
    # 16 blocks of 720 KiB (see test_engine's small-pool test), two sequences per step
    eng = Engine(EngineConfig(kv_memory_mib=16 * 0.703125, block_size=16, max_batch=2))
    eng.start()
    assert eng.wait_ready(600), eng.load_error
    assert eng.model_info.num_blocks == 16
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def wide():
    """The same 16 blocks, eight sequences per step: six chats outgrow the pool (preemption)."""
    eng = Engine(EngineConfig(kv_memory_mib=16 * 0.703125, block_size=16, max_batch=8))
    eng.start()
    assert eng.wait_ready(600), eng.load_error
    yield eng
    eng.stop()


def _first_snapshot_after_the_next_step(engine: Engine):
    before = engine.snapshot().counters.steps
    wait_until(lambda: engine.snapshot().counters.steps > before)
    return engine.snapshot()


def test_stream_yields_each_requests_events_in_asyncio_without_blocking(engine):
    prompts = [chat_prompt(user(q)) for q in QUESTIONS[:2]]
    expected = [greedy_reference(p, 16) for p in prompts]
    arrivals: list[tuple[int, str]] = []

    async def read(i: int, handle) -> tuple[list[int], list[FinalEvent]]:
        tokens, finals = [], []
        async for event in handle.stream():
            if isinstance(event, TokenEvent):
                tokens.extend(event.token_ids)
                arrivals.append((i, "token"))
            else:
                finals.append(event)
                arrivals.append((i, "final"))
        return tokens, finals

    async def main():
        handles = [engine.submit(prompt_tokens=p, params=greedy(16), session_id=f"async-{i}")
                   for i, p in enumerate(prompts)]
        return await asyncio.gather(*(read(i, h) for i, h in enumerate(handles)))

    results = asyncio.run(main())
    for i, (tokens, finals) in enumerate(results):
        assert tokens == expected[i] and len(finals) == 1
        assert finals[0].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    # both streams were read on one loop at the same time: their events interleave
    first_final = min(arrivals.index((i, "final")) for i in range(2))
    assert {i for i, kind in arrivals[:first_final] if kind == "token"} == {0, 1}


LONG_ANSWERS = [
    "Write a long story about a dragon who learns to bake bread.",
    "Explain in detail how a steam engine works, step by step.",
]


def test_cancelling_a_waiting_request(engine):
    # Two chats whose greedy replies run the full 64 tokens (a short answer could end before
    # the waiter is cancelled), 7 blocks each: both fit the 16-block pool. The third, with
    # the longest prompt (admission takes the shortest first), waits for a batch slot.
    prompts = [chat_prompt(user(q)) for q in LONG_ANSWERS]
    runners = [engine.submit(prompt_tokens=p, params=greedy(64), session_id=f"run-{i}")
               for i, p in enumerate(prompts)]
    longest = ("Explain what a KV cache is in one sentence, and say why a chat app that runs"
               " several conversations at the same time needs one.")
    assert len(chat_prompt(user(longest))) > max(map(len, prompts))
    waiting = engine.submit(messages=user(longest), params=greedy(24), session_id="waiter")

    def is_waiting() -> bool:
        stats = engine.snapshot().sessions.get("waiter")
        return stats is not None and stats.state is SequenceState.WAITING

    wait_until(lambda: is_waiting() and all(r.token_events >= 1 for r in runners))
    waiting.cancel()
    tokens, finals = collect(waiting)
    assert finals[0].finish_reason is FinishReason.CANCELLED
    assert tokens == {} and finals[0].usage.generated_tokens == 0
    snap = _first_snapshot_after_the_next_step(engine)
    assert snap.sessions["waiter"].blocks_held == 0 and snap.sessions["waiter"].requests == 0
    # the running chats go on, untouched: each ends on its own, exactly as mlx-lm replies
    for prompt, runner in zip(prompts, runners):
        tokens, finals = collect(runner)
        assert finals[0].finish_reason is FinishReason.LENGTH
        assert tokens[0] == greedy_reference(prompt, 64)
    # the engine still answers exactly as mlx-lm does
    prompt = chat_prompt(user(QUESTIONS[3]))
    tokens, _ = collect(engine.submit(prompt_tokens=prompt, params=greedy(12), session_id="after"))
    assert tokens[0] == greedy_reference(prompt, 12)
    wait_until(lambda: engine.snapshot().used_blocks == 0, timeout=30)
    assert not any("waiter" in owners for owners in engine.snapshot().owners)


def test_cancelling_a_preempted_request(wide):
    engine = wide
    prompts = [chat_prompt(user(q)) for q in QUESTIONS]
    expected = [greedy_reference(p, 40) for p in prompts]
    before = engine.snapshot().counters.preemptions
    handles = [engine.submit(prompt_tokens=p, params=greedy(40), session_id=f"pre-{i}")
               for i, p in enumerate(prompts)]
    victim: list[int] = []

    def find_preempted() -> bool:
        snap = engine.snapshot()
        for i in range(len(prompts)):
            stats = snap.sessions.get(f"pre-{i}")
            if stats is not None and stats.state is SequenceState.PREEMPTED:
                victim.append(i)
                return True
        return all(h.done for h in handles)

    wait_until(find_preempted, timeout=600)
    assert victim, "no request was preempted"
    v = victim[0]
    handles[v].cancel()
    results = [collect(h) for h in handles]
    assert results[v][1][0].finish_reason is FinishReason.CANCELLED
    for i, (tokens, finals) in enumerate(results):
        if i == v:
            continue
        assert finals[0].finish_reason is not FinishReason.ERROR, finals[0].error
        assert tokens[0] == expected[i], f"chat {i} changed after a preempted one was cancelled"
    assert engine.snapshot().counters.preemptions > before
    wait_until(lambda: engine.snapshot().used_blocks == 0)
    assert not any(f"pre-{v}" in owners for owners in engine.snapshot().owners)


def test_submit_and_cancel_from_several_threads_at_once(wide):
    engine = wide
    prompts = [chat_prompt(user(q)) for q in QUESTIONS[:2]]
    expected = [greedy_reference(p, 10) for p in prompts]
    threads_n, per_thread = 4, 5
    start = threading.Barrier(threads_n)
    outcomes: list[tuple[str, int, dict, dict]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(t: int) -> None:
        try:
            start.wait()
            mine = []
            for k in range(per_thread):
                p = (t + k) % 2
                h = engine.submit(prompt_tokens=prompts[p], params=greedy(10),
                                  session_id=f"thr-{t}-{k}")
                mode = ("at once", "after a token", "never")[k % 3]
                if mode == "at once":
                    h.cancel()
                mine.append((mode, p, h))
            for mode, p, h in mine:
                if mode == "after a token":
                    wait_until(lambda h=h: h.token_events >= 1 or h.done)
                    h.cancel()
                tokens, finals = collect(h)
                with lock:
                    outcomes.append((mode, p, tokens, finals))
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    assert not errors, errors
    assert len(outcomes) == threads_n * per_thread
    for mode, p, tokens, finals in outcomes:
        assert list(finals) == [0]  # exactly one final event per request
        reason = finals[0].finish_reason
        assert reason is not FinishReason.ERROR, finals[0].error
        if mode == "never" or reason is not FinishReason.CANCELLED:
            assert tokens[0] == expected[p]  # a reply that ran to its end is mlx-lm's
        else:  # a cancelled reply is a prefix of it
            assert expected[p][:len(tokens.get(0, []))] == tokens.get(0, [])
    wait_until(lambda: engine.snapshot().used_blocks == 0)
    assert not any(o for o in engine.snapshot().owners)
