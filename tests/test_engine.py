"""The engine on the real embedded model, against mlx-lm's own generation.

One engine per module (loading takes seconds); each test uses its own session ids.
References come from a separate model instance, computed while the engine is idle.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from engine import (
    Engine,
    EngineConfig,
    FinishReason,
    SamplingParams,
    SequenceState,
    TokenEvent,
)
from engine.runner import step
from tests.reference import (
    chat_prompt,
    collect,
    greedy_reference,
    sampled_reference,
    session_blocks,
    wait_until,
)

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
SYSTEM = (
    "You are a careful assistant for a small bakery. Answer briefly, in plain words, and "
    "always mention that fresh bread is baked every morning at six o'clock."
)
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain what a KV cache is in one sentence.",
    "Give me a short tip for learning to cook.",
    "What is 12 times 12?",
    "Say hello in Spanish and in German.",
]


def user(text: str, system: str | None = None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def engine():
    eng = Engine(EngineConfig(kv_memory_mib=64, block_size=16, max_batch=16, prefill_chunk=128,
                              overlap=True))  # the GPU default; the CPU's is off
    eng.start()
    assert eng.wait_ready(600), eng.load_error
    yield eng
    eng.stop()


def test_greedy_generation_equals_mlx_lm(engine: Engine) -> None:
    prompts = [chat_prompt(user(q)) for q in QUESTIONS[:5]]
    expected = [greedy_reference(p, GREEDY.max_tokens) for p in prompts]
    handles = [
        engine.submit(prompt_tokens=p, params=GREEDY, session_id=f"greedy-{i}")
        for i, p in enumerate(prompts)
    ]
    for i, handle in enumerate(handles):
        tokens, finals = collect(handle)
        assert tokens[0] == expected[i], f"prompt {i} diverged"
        assert finals[0].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert finals[0].usage.generated_tokens == len(expected[i])


def test_shared_system_prompt_reuses_cached_blocks(engine: Engine) -> None:
    first = chat_prompt(user(QUESTIONS[0], SYSTEM))
    second = chat_prompt(user(QUESTIONS[1], SYSTEM))
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert common >= 40
    expected = greedy_reference(second, 24)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    collect(engine.submit(prompt_tokens=first, params=params, session_id="prefix-a"))
    hits_before = engine.snapshot().counters.prefix_cache_hits
    tokens, finals = collect(engine.submit(prompt_tokens=second, params=params,
                                           session_id="prefix-b"))
    full_blocks = common // 16
    assert finals[0].usage.cached_prompt_tokens == full_blocks * 16
    wait_until(lambda: engine.snapshot().counters.prefix_cache_hits >= hits_before + full_blocks)
    assert tokens[0] == expected


def test_fork_after_prompt_copies_the_shared_partial_block(engine: Engine) -> None:
    prompt = chat_prompt(user("Tell me a story about a dragon."))
    full, tail = divmod(len(prompt), 16)
    assert tail and full  # the last prompt block is partial: forks must copy it
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=7, n=3)
    handle = engine.submit(prompt_tokens=prompt, params=params, session_id="fork")
    prompt_blocks = [tuple(prompt[i * 16:(i + 1) * 16]) for i in range(full)]
    prompt_tail = tuple(prompt[full * 16:])

    def layout():
        snap = engine.snapshot()
        held = [b for b in range(snap.num_blocks) if "fork" in snap.owners[b]]
        whole = [b for b in held if snap.block_tokens[b] in prompt_blocks]
        tails = [b for b in held if b not in whole and snap.block_tokens[b][:tail] == prompt_tail]
        return snap, held, whole, tails

    # the first snapshot where every sample has written past the prompt (or the reply ended)
    wait_until(lambda: handle.done or len([b for b in layout()[3]
                                           if layout()[0].refcounts[b] == 1]) >= 3)
    snap, held, whole, tails = layout()
    assert not handle.done, "the request ended before a snapshot showed the fork"
    # the prompt's full blocks are stored once, held by all three samples
    assert sorted(snap.block_tokens[b] for b in whole) == sorted(prompt_blocks)
    assert [snap.refcounts[b] for b in whole] == [3] * full
    # the partial block: the original plus exactly one copy per extra sample, each private
    assert len(tails) == 3 and [snap.refcounts[b] for b in tails] == [1, 1, 1]
    assert all(snap.refcounts[b] == 1 for b in held if b not in whole)
    tokens, finals = collect(handle)
    assert len(finals) == 3
    assert len({tuple(t) for t in tokens.values()}) > 1, "samples did not diverge"
    for index, drawn in tokens.items():
        assert drawn == sampled_reference(prompt, params, index, drawn), f"sample {index}"


def test_sampled_reply_with_every_filter_follows_the_numpy_oracle(engine: Engine) -> None:
    """top-p, top-k, min-p and the repetition penalty, through the engine's batch, replayed
    with the independent oracle and the documented key stream."""
    prompt = chat_prompt(user("Invent a name for a cat and say why."))
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, min_p=0.05,
                            repetition_penalty=1.3, max_tokens=24, seed=99)
    tokens, _ = collect(engine.submit(prompt_tokens=prompt, params=params, session_id="filters"))
    assert len(tokens[0]) > 4
    assert tokens[0] == sampled_reference(prompt, params, 0, tokens[0])


def test_eight_chats_arriving_at_different_times_match_their_solo_runs(engine: Engine) -> None:
    """Each chat equals its solo run, and they ran together: the engine took far fewer
    steps than the tokens it produced (one chat per step would take at least as many)."""
    prompts = [chat_prompt(user(q)) for q in QUESTIONS]
    budgets = [12, 40, 20, 32, 16, 40, 24, 28]
    expected = [greedy_reference(p, n) for p, n in zip(prompts, budgets)]
    steps_before = engine.runtime.scheduler.steps
    handles = []
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        if handles:  # the next chat arrives while the earlier ones are streaming
            wait_until(lambda h=handles[-1]: h.token_events >= 2 or h.done)
        handles.append(engine.submit(
            prompt_tokens=prompt, params=SamplingParams(temperature=0.0, max_tokens=budget),
            session_id=f"eight-{i}",
        ))
    produced = 0
    for i, handle in enumerate(handles):
        tokens, _ = collect(handle)
        assert tokens[0] == expected[i], f"chat {i} diverged in the batch"
        produced += len(tokens[0])
    steps = engine.runtime.scheduler.steps - steps_before
    assert produced >= 150 and steps <= produced // 2, (steps, produced)


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(engine: Engine) -> None:
    long_text = " ".join(f"Item {i} is a line of a long shopping list." for i in range(70))
    long_prompt = chat_prompt(user(long_text + " Which item comes first?"))
    chunks = -(-len(long_prompt) // 128)
    assert chunks >= 5
    expected = greedy_reference(long_prompt, 8)
    runner = engine.submit(messages=user("Count from one to fifty in words."),
                           params=SamplingParams(temperature=0.0, max_tokens=200),
                           session_id="chunk-runner")
    wait_until(lambda: runner.token_events >= 2)
    before = runner.token_events
    joiner = engine.submit(prompt_tokens=long_prompt,
                           params=SamplingParams(temperature=0.0, max_tokens=8),
                           session_id="chunk-joiner")
    first = next(e for e in joiner if isinstance(e, TokenEvent))
    # One decode step of the running chat per prompt chunk, at least.
    assert runner.token_events - before >= chunks - 1
    rest, _ = collect(joiner)
    assert list(first.token_ids) + rest.get(0, []) == expected
    runner.cancel()
    collect(runner)


def _first_snapshot_after_the_next_step(engine: Engine):
    """The earliest snapshot that is certainly later than a cancel whose final event has
    arrived: the snapshot read now may predate the cancel, but the engine counts a step only
    after draining its inbox, so one with a higher step count comes after it."""
    before = engine.snapshot().counters.steps
    wait_until(lambda: engine.snapshot().counters.steps > before)
    return engine.snapshot()


def test_cancel_frees_blocks_at_once_and_deleted_session_ends_cancelled(engine: Engine) -> None:
    # a running chat keeps the engine stepping (so snapshots come from steps, not idleness)
    runner = engine.submit(messages=user("Count from one to fifty in words."),
                           params=SamplingParams(temperature=0.0, max_tokens=400),
                           session_id="cancel-runner")
    handle = engine.submit(messages=user("Write a long poem about autumn."),
                           params=SamplingParams(temperature=0.0, max_tokens=400),
                           session_id="cancel-me")
    wait_until(lambda: handle.token_events >= 3 and session_blocks(engine, "cancel-me") > 0)
    handle.cancel()
    _, finals = collect(handle)
    assert finals[0].finish_reason is FinishReason.CANCELLED
    snap = _first_snapshot_after_the_next_step(engine)
    assert snap.sessions["cancel-me"].blocks_held == 0
    assert not any("cancel-me" in owners for owners in snap.owners)
    assert snap.sessions["cancel-runner"].blocks_held > 0 and not runner.done

    other = engine.submit(messages=user("Describe a forest."),
                          params=SamplingParams(temperature=0.0, max_tokens=400),
                          session_id="deleted-chat")
    wait_until(lambda: other.token_events >= 1)
    engine.cancel_session("deleted-chat")
    _, finals = collect(other)
    assert finals[0].finish_reason is FinishReason.CANCELLED
    snap = _first_snapshot_after_the_next_step(engine)
    assert "deleted-chat" not in snap.sessions
    assert not any("deleted-chat" in owners for owners in snap.owners)
    runner.cancel()
    collect(runner)


def test_seed_reproduces_and_stop_and_max_tokens_end_replies(engine: Engine) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=1234)
    msgs = user("Invent a name for a cat.")
    a, _ = collect(engine.submit(messages=msgs, params=params, session_id="seed-a"))
    b, _ = collect(engine.submit(messages=msgs, params=params, session_id="seed-b"))
    assert a[0] == b[0]

    _, finals = collect(engine.submit(messages=user(QUESTIONS[0]),
                                      params=SamplingParams(temperature=0.0, stop=("Paris",)),
                                      session_id="stop"))
    assert finals[0].finish_reason is FinishReason.STOP
    assert finals[0].text == "The capital of France is "

    tokens, finals = collect(engine.submit(messages=user(QUESTIONS[2]),
                                           params=SamplingParams(temperature=0.0, max_tokens=5),
                                           session_id="length"))
    assert finals[0].finish_reason is FinishReason.LENGTH and len(tokens[0]) == 5


def test_over_long_prompt_ends_with_a_clear_error_and_engine_keeps_serving(engine) -> None:
    too_long = [1] * (engine.model_info.max_context + 5)
    _, finals = collect(engine.submit(prompt_tokens=too_long, session_id="too-long"))
    assert finals[0].finish_reason is FinishReason.ERROR
    assert "context limit" in finals[0].error
    _, finals = collect(engine.submit(messages=user(QUESTIONS[0]),
                                      params=SamplingParams(temperature=0.0, max_tokens=8),
                                      session_id="after-error"))
    assert finals[0].finish_reason is not FinishReason.ERROR
    with pytest.raises(ValueError):
        engine.submit(messages=[{"role": "user", "content": "   "}])


def test_a_failing_request_fails_alone(engine: Engine, monkeypatch) -> None:
    expected = greedy_reference(chat_prompt(user(QUESTIONS[3])), 16)
    real_sampling_row = step.sampling_row

    def explode(seq):
        if seq.session_id == "faulty" and seq.num_generated >= 2:
            raise RuntimeError("injected fault")
        return real_sampling_row(seq)

    monkeypatch.setattr(step, "sampling_row", explode)
    bad = engine.submit(messages=user(QUESTIONS[4]),
                        params=SamplingParams(temperature=0.0, max_tokens=30),
                        session_id="faulty")
    good = engine.submit(messages=user(QUESTIONS[3]),
                         params=SamplingParams(temperature=0.0, max_tokens=16),
                         session_id="healthy")
    _, bad_finals = collect(bad)
    tokens, good_finals = collect(good)
    monkeypatch.undo()
    assert bad_finals[0].finish_reason is FinishReason.ERROR
    assert "injected fault" in bad_finals[0].error
    assert good_finals[0].finish_reason is not FinishReason.ERROR
    assert tokens[0] == expected
    wait_until(lambda: session_blocks(engine, "faulty") == 0, timeout=5)


def test_snapshot_reports_sessions_blocks_and_counters(engine: Engine) -> None:
    handle = engine.submit(messages=user(QUESTIONS[5], SYSTEM),
                           params=SamplingParams(temperature=0.0, max_tokens=300),
                           session_id="snap")
    # Snapshots are built when asked, between steps: poll until one shows the chat decoding.
    wait_until(lambda: handle.token_events >= 3 and getattr(
        engine.snapshot().sessions.get("snap"), "state", None) is SequenceState.DECODING)
    snap = engine.snapshot()
    stats = snap.sessions["snap"]
    assert stats.state is SequenceState.DECODING
    held = [b for b in range(snap.num_blocks) if "snap" in snap.owners[b]]
    assert stats.blocks_held == len(held) > 0
    assert all(snap.refcounts[b] >= 1 for b in held)
    assert stats.tokens_in_context == sum(snap.fills[b] for b in held)
    assert snap.counters.steps > 0 and snap.counters.tokens_per_s > 0
    with pytest.raises(AttributeError):
        snap.num_blocks = 3  # immutable
    handle.cancel()
    collect(handle)


def test_small_pool_preempts_and_every_chat_still_matches() -> None:
    prompts = [chat_prompt(user(q)) for q in QUESTIONS[:6]]
    expected = [greedy_reference(p, 40) for p in prompts]
    # 30 layers x 2 x 3 heads x 64 dims x 4 bytes x 16 slots = 720 KiB per block: 16 blocks,
    # while the six chats need about 30 at their longest.
    small = Engine(EngineConfig(kv_memory_mib=16 * 0.703125, block_size=16, max_batch=8))
    small.start()
    try:
        assert small.wait_ready(600), small.load_error
        assert small.model_info.num_blocks == 16
        handles = [small.submit(prompt_tokens=p,
                                params=SamplingParams(temperature=0.0, max_tokens=40),
                                session_id=f"tiny-{i}") for i, p in enumerate(prompts)]
        results = [collect(h) for h in handles]
        snap = small.snapshot()
    finally:
        small.stop()
    assert snap.counters.preemptions > 0
    for i, (tokens, finals) in enumerate(results):
        assert finals[0].finish_reason is not FinishReason.ERROR, finals[0].error
        assert tokens[0] == expected[i], f"chat {i} changed after preemption"
    assert snap.used_blocks == 0


def test_a_stopped_engine_gives_its_model_and_pool_back_at_once() -> None:
    """The app's model switch stops one engine, then starts the next: the old model and pool
    must be freed by stop(), not whenever the cyclic garbage collector next runs (the
    runtime's parts hold callbacks into each other; the switch loaded the new model beside
    the old one). Automatic collection is off here, and the test keeps its own reference to
    the stopped engine, as the app's bridge does while it starts the next."""
    gc.collect()
    before = mx.get_active_memory()
    gc.disable()
    try:
        eng = Engine(EngineConfig(kv_memory_mib=32, block_size=16, max_batch=4))
        eng.start()
        assert eng.wait_ready(600), eng.load_error
        collect(eng.submit(messages=user("Hi"),
                           params=SamplingParams(temperature=0.0, max_tokens=4)))
        loaded = mx.get_active_memory() - before
        assert loaded > 100 * 2**20  # the weights and the pool
        eng.stop()
        assert eng.runtime is None and eng.status == "stopped"
        assert mx.get_active_memory() - before < 0.02 * loaded
    finally:
        gc.enable()


def test_failed_load_answers_requests_with_the_load_error(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    broken = Engine(EngineConfig(model=str(missing)))
    with pytest.raises(RuntimeError):
        broken.submit(messages=user("hi"))  # not started
    broken.start()
    try:
        assert not broken.wait_ready(60)
        assert broken.status == "error" and str(missing) in broken.load_error
        _, finals = collect(broken.submit(messages=user("hi"), params=SamplingParams(n=2)))
        assert {f.finish_reason for f in finals.values()} == {FinishReason.ERROR}
        assert len(finals) == 2 and all(f.error == broken.load_error for f in finals.values())
    finally:
        broken.stop()


def test_snapshot_reports_the_prompt_progress_of_a_long_prompt(engine: Engine) -> None:
    long_text = " ".join(f"Entry {i} of a long inventory of garden tools." for i in range(90))
    long_prompt = chat_prompt(user(long_text + " Which entry is first?"))
    runner = engine.submit(messages=user("Count from one to fifty in words."),
                           params=SamplingParams(temperature=0.0, max_tokens=300),
                           session_id="progress-runner")
    wait_until(lambda: runner.token_events >= 2)
    seen: list[tuple[int, int]] = []

    def progress() -> bool:
        stats = engine.snapshot().sessions.get("progress-long")
        if stats is not None and stats.prompt_tokens_total:
            seen.append((stats.prompt_tokens_done, stats.prompt_tokens_total))
        return stats is not None and stats.state is SequenceState.DECODING

    handle = engine.submit(prompt_tokens=long_prompt,
                           params=SamplingParams(temperature=0.0, max_tokens=200),
                           session_id="progress-long")
    wait_until(progress)
    assert {total for _, total in seen} == {len(long_prompt)}
    partial = [done for done, _ in seen if 0 < done < len(long_prompt)]
    assert len(set(partial)) >= 2 and partial == sorted(partial)  # it advanced, visibly
    assert engine.snapshot().sessions["progress-long"].prompt_tokens_total == 0  # decoding now
    for h in (runner, handle):
        h.cancel()
        collect(h)


def test_overlapped_steps_equal_the_synchronous_path(engine: Engine) -> None:
    """Two fresh engines, one overlapping its steps, run the same chats. Every reply ends
    at its max_tokens at the same step, so both engines batch the same rows in every step
    (a reply ending early adds one speculative row to the overlapped engine's next step,
    which changes the other rows' logits in their last bits) and the tokens must be equal,
    sampled ones included. One chat has the app's default sampling (a repetition penalty
    over 128 tokens): the overlapped engine still launched nearly every step before it had
    read the previous one's tokens, and the synchronous one never did."""
    assert engine.config.overlap  # the suite's engines run the overlapped (GPU default) path
    workload = [
        (user(QUESTIONS[2]), SamplingParams(temperature=0.0, max_tokens=14)),
        (user(QUESTIONS[4]), SamplingParams(temperature=0.3, top_p=0.9, max_tokens=14,
                                            repetition_penalty=1.15,
                                            repetition_context_size=128, seed=5)),
        (user(QUESTIONS[5]), SamplingParams(temperature=0.7, max_tokens=14, seed=8, n=2)),
    ]

    def run(overlap: bool) -> tuple[dict, list, dict]:
        # speculative off: a row that may draft makes its step synchronous (ARCHITECTURE
        # §3.13), and this test counts the steps launched ahead
        eng = Engine(EngineConfig(kv_memory_mib=32, block_size=16, max_batch=16,
                                  prefill_chunk=256, overlap=overlap, speculative=False))
        eng.start()
        try:
            assert eng.wait_ready(600), eng.load_error
            handles = [eng.submit(messages=m, params=p, session_id=f"ov-{i}")
                       for i, (m, p) in enumerate(workload)]
            results = {}
            for i, h in enumerate(handles):
                tokens, finals = collect(h)
                for index, final in finals.items():
                    results[i, index] = (tokens.get(index, []), final.text,
                                         final.finish_reason)
            wait_until(lambda: eng.snapshot().counters.batch_size == 0)
            stats = {"steps": eng.runtime.scheduler.steps,
                     "ahead": eng.runtime.stepper.launched_ahead}
        finally:
            eng.stop()
        return results, handles, stats

    expected, _, sync_stats = run(overlap=False)
    got, handles, stats = run(overlap=True)
    assert {r[2] for r in expected.values()} == {FinishReason.LENGTH}  # all end together
    assert got == expected
    # Every step but the first launch and the last read (nothing in flight, nothing left
    # to launch) was launched with the previous one's tokens unread: 20 of 22 measured;
    # without overlap none, and an engine alternating a launch with a read-only step (each
    # sequence decoding every other step) about half.
    assert sync_stats["ahead"] == 0
    assert stats["ahead"] >= 11 and stats["ahead"] >= 0.75 * stats["steps"], stats
    # ...and overlapping cost no extra steps (22 against 21 measured). Sequences that sit
    # out every other step (their token in flight unseen) interleave here (23 against 21):
    # tests/test_overlap_sampling.py is the test that catches that.
    assert stats["steps"] <= 1.2 * sync_stats["steps"] + 1, (stats, sync_stats)
    for h in handles:  # nothing followed a final: collect() read every event pushed
        assert not h._events


def test_overlapped_replies_end_exactly_at_stop_strings_and_max_tokens(engine) -> None:
    handles = [
        engine.submit(messages=user(QUESTIONS[0]), session_id="ov-stop",
                      params=SamplingParams(temperature=0.0, stop=("Paris",))),
        engine.submit(messages=user(QUESTIONS[7]), session_id="ov-one",
                      params=SamplingParams(temperature=0.0, max_tokens=1)),
        engine.submit(messages=user(QUESTIONS[1]), session_id="ov-long",
                      params=SamplingParams(temperature=0.0, max_tokens=30)),
    ]
    results = [collect(h) for h in handles]
    assert results[0][1][0].text == "The capital of France is "
    assert results[0][1][0].finish_reason is FinishReason.STOP
    assert len(results[1][0][0]) == 1 and results[1][1][0].finish_reason is FinishReason.LENGTH
    wait_until(lambda: engine.snapshot().counters.batch_size == 0)
    for h in handles:
        assert not h._events


def test_steps_overlap_by_default_only_on_a_gpu() -> None:
    """On the CPU backend building the next step competes with the forward for the same
    cores (bench: 8 chats 47 vs 57 tok/s), so only a GPU overlaps unless the config says."""
    from engine.config import overlap_steps

    default = EngineConfig()
    assert default.overlap is None
    assert overlap_steps(default, on_gpu=True) and not overlap_steps(default, on_gpu=False)
    assert overlap_steps(EngineConfig(overlap=True), on_gpu=False)
    assert not overlap_steps(EngineConfig(overlap=False), on_gpu=True)
