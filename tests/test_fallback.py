"""The fallback engine: an architecture that fails the paged check runs on mlx-lm's own
BatchGenerator behind the same public Engine API (engine/runner/fallback.py).

The model is a tiny random Gemma 3 whose sliding-window layers (a window of 8 tokens) the
paged pool does not model; the references are mlx-lm's own generation on a separate copy of
the same folder.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, FinishReason, SamplingParams, TokenEvent
from tests.reference import collect, reference_model, wait_until
from tests.tiny_model import GEMMA2, GEMMA3, make_tiny_model, mlx_lm_greedy

PROMPT_LENGTHS = (5, 17, 30)
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fallback") / "tiny-gemma3",
                           reference_model().path, config=GEMMA3)


@pytest.fixture(scope="module")
def engine(gemma3):
    eng = Engine(EngineConfig(model=str(gemma3), kv_memory_mib=8, block_size=8, max_batch=8))
    eng.start()
    assert eng.wait_ready(300), eng.load_error
    yield eng
    eng.stop()


def prompts() -> list[list[int]]:
    return [[(5 * i + 7 * j) % 97 + 3 for i in range(n)] for j, n in enumerate(PROMPT_LENGTHS)]


def test_a_refused_architecture_loads_unpaged_and_says_why(engine):
    info = engine.model_info
    assert info.model_type == "gemma3_text" and not info.paged
    assert info.attention == "mlx-lm" and info.num_blocks == 0
    assert "sliding-window attention (a window of 8 tokens)" in info.not_paged_reason
    snap = engine.snapshot()
    assert not snap.paged and snap.num_blocks == 0


def test_concurrent_greedy_replies_equal_mlx_lm_and_share_steps(engine, gemma3):
    """Three ragged prompts at once: each greedy reply equals mlx-lm's own generation token
    for token, and they ran in one batch (fewer engine steps than tokens generated)."""
    before = engine.snapshot().counters
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    handles = [engine.submit(prompt_tokens=p, params=params, session_id=f"chat-{j}")
               for j, p in enumerate(prompts())]
    results = [collect(h) for h in handles]
    generated = 0
    for prompt, (tokens, finals) in zip(prompts(), results):
        assert finals[0].finish_reason is FinishReason.LENGTH, finals[0].error
        assert tokens[0] == mlx_lm_greedy(gemma3, prompt, MAX_TOKENS)
        assert finals[0].usage.generated_tokens == MAX_TOKENS
        generated += len(tokens[0])
    # The snapshot that counted every one of these tokens (published at the latest when the
    # engine went idle) also counted the steps they took: one at a time would be >= 60.
    wait_until(lambda: engine.snapshot().counters.generated_tokens
               == before.generated_tokens + generated, timeout=60)
    steps = engine.snapshot().counters.steps - before.steps
    assert steps < generated, (steps, generated)


def test_cancel_ends_one_reply_and_the_others_go_on(engine, gemma3):
    params = SamplingParams(temperature=0.0, max_tokens=400)
    first_token = threading.Event()
    long = engine.submit(prompt_tokens=prompts()[2], params=params, session_id="long")
    short = engine.submit(prompt_tokens=prompts()[0],
                          params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                          session_id="short")
    got = []
    for event in long:
        if isinstance(event, TokenEvent):
            got.extend(event.token_ids)
            if not first_token.is_set():
                first_token.set()
                long.cancel()
        else:
            final = event
    assert final.finish_reason is FinishReason.CANCELLED
    assert 0 < len(got) < 400
    tokens, finals = collect(short)
    assert finals[0].finish_reason is FinishReason.LENGTH
    assert tokens[0] == mlx_lm_greedy(gemma3, prompts()[0], MAX_TOKENS)


def test_samples_and_seeds_work_unpaged(engine):
    """n = 2 gives two finals; a seeded sampled request replays exactly when run alone."""
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=7, n=2)
    a, fa = collect(engine.submit(prompt_tokens=prompts()[1], params=params))
    b, fb = collect(engine.submit(prompt_tokens=prompts()[1], params=params))
    assert sorted(fa) == [0, 1] and all(f.finish_reason is FinishReason.LENGTH
                                        for f in fa.values())
    assert a == b
    assert a[0] != a[1]  # two samples with their own keys


def test_monitor_shows_the_not_paged_view(engine, qtbot, qasync_loop, app_env):
    """The KV monitor has no blocks to draw: its not-paged page names the model, explains
    and counts the chats generating, live."""
    from tests.app_helpers import WAIT_MS, open_window

    h = open_window(qtbot, app_env, engine)
    try:
        panel = h.window.monitor_dock.widget()
        qtbot.waitUntil(lambda: panel.pages.currentWidget() is panel.not_paged,
                        timeout=WAIT_MS)
        text = panel.not_paged.text()
        assert "tiny-gemma3 is not paged" in text and "mlx-lm's own KV cache" in text
        assert "sliding-window attention" in panel.not_paged.toolTip()
        handle = engine.submit(prompt_tokens=prompts()[0],
                               params=SamplingParams(temperature=0.0, max_tokens=4000),
                               session_id="monitored")
        qtbot.waitUntil(lambda: "1 chat generating" in panel.not_paged.text(),
                        timeout=WAIT_MS)
        handle.cancel()
        qtbot.waitUntil(lambda: "0 chats generating" in panel.not_paged.text(),
                        timeout=WAIT_MS)
        assert not panel.block_map.isVisible()
        assert h.window.pool_label.text().startswith("Not paged")
        assert "not paged" in h.window.model_button.toolTip()
    finally:
        h.close()


def test_a_model_mlx_lm_cannot_batch_is_served_one_chat_at_a_time(tmp_path):
    """mlx-lm's gemma2 fails under its own BatchGenerator as soon as ragged prompts share a
    prefill (its attention mask does not broadcast over the batch); the fallback then serves
    one row at a time, re-feeding each row's tokens, so the replies still equal mlx-lm's own
    generation and nothing fails. Driven below the engine's inbox, so both prompts are surely
    queued before the first step."""
    from engine.handle import RequestHandle
    from engine.models.folder import load_folder
    from engine.requests.admission import admit
    from engine.runner.fallback import FallbackRunner, FallbackScheduler
    from engine.runner.output import Output
    from engine.runner.telemetry import Telemetry

    folder = make_tiny_model(tmp_path / "tiny-gemma2", reference_model().path, config=GEMMA2)
    loaded = load_folder(folder)
    sched = FallbackScheduler(max_batch=8)
    telemetry = Telemetry()
    output = Output(telemetry, set(loaded.tokenizer.eos_token_ids), 512)
    runner = FallbackRunner(loaded.model, sched, output, telemetry, 512, prefill_chunk=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    handles = []
    for j, prompt in enumerate(prompts()):
        handle = RequestHandle(f"r{j}", f"s{j}", 1, lambda h: None)
        request, refusal = admit(f"r{j}", f"s{j}", None, prompt, params, handle,
                                 loaded.tokenizer, 512)
        assert refusal is None
        output.requests[request.request_id] = request
        sched.add(request.sequences[0])
        handles.append(handle)
    while sched.has_work:
        runner.step()
    runner.discard_inflight()
    assert runner.max_rows == 1  # batching failed once, then one row at a time
    for prompt, handle in zip(prompts(), handles):
        tokens, finals = collect(handle)
        assert finals[0].finish_reason is FinishReason.LENGTH, finals[0].error
        assert tokens[0] == mlx_lm_greedy(folder, prompt, MAX_TOKENS)


def test_a_window_longer_than_the_check_still_falls_back(tmp_path):
    """A sliding window of 64 tokens is wider than the load-time check's prompt, which it
    would pass; the model would then answer wrongly past 64 tokens on the pool. The engine
    reads the window off mlx-lm's own cache types instead: not paged, and a 100-token prompt
    gets mlx-lm's own greedy reply."""
    config = {**GEMMA3, "sliding_window": 64}
    folder = make_tiny_model(tmp_path / "tiny-gemma3-w64", reference_model().path,
                             config=config)
    eng = Engine(EngineConfig(model=str(folder), kv_memory_mib=8, block_size=8))
    eng.start()
    try:
        assert eng.wait_ready(300), eng.load_error
        info = eng.model_info
        prompt = [(3 * i + 11) % 97 + 3 for i in range(100)]
        tokens, finals = collect(eng.submit(prompt_tokens=prompt, params=SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS)))
    finally:
        eng.stop()
    assert not info.paged and "sliding-window attention (a window of 64 tokens)" in \
        info.not_paged_reason
    # The premise: the short load-time check alone would have let it run paged.
    from engine.models.folder import load_folder
    from engine.runner.architecture import check_paged_matches, probe_kv_shape

    model = load_folder(folder).model
    assert check_paged_matches(model, probe_kv_shape(model), 8) < 1e-3
    assert finals[0].finish_reason is FinishReason.LENGTH, finals[0].error
    assert tokens[0] == mlx_lm_greedy(folder, prompt, MAX_TOKENS)
