"""Every chat overlaps: sampling parameters never force a synchronous step.

The repetition penalty's window and seeded rows' keys live on the device and are carried
from step to step (engine/runner/step.py, engine/runner/sampling.py), the token in flight appended
lazily. These tests run one workload of penalised, seeded, stopped and forked (n = 3)
replies on the tiny model, with a roomy pool and with one so small that sequences are
preempted and recomputed, once with overlapped steps and once synchronously, and check:

- both give the same tokens, texts and finish reasons;
- the tokens are right, against independent references: greedy replies against mlx-lm's
  own generation with its repetition-penalty processor, sampled ones against the numpy
  oracle replayed with the documented key stream (tests/reference.py);
- the overlapped engine really launched its steps ahead (the previous step's tokens still
  unread on the device), penalised rows and all, and took no more steps than the
  synchronous one (every sequence decoded every step); the synchronous one never ran ahead.

The workload's windows differ (6, 12 and 128 tokens) and its replies end at different
steps, so the rows' state is rebuilt mid-flight as rows leave and the widest window goes,
as well as carried. A last test reruns a step after the next one was launched (a failed
read) and checks that no seeded stream lost or repeated a key.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

import engine.runner.step as step_module
from engine import Engine, EngineConfig, FinishReason, SamplingParams
from tests.reference import (
    collect,
    key_stream,
    oracle_distribution,
    oracle_draw,
    reference_model,
    wait_until,
)
from tests.tiny_model import budget_mib, make_tiny_model, reference_copy

BLOCK = 8
APP_DEFAULT = dict(temperature=0.3, top_p=0.9, repetition_penalty=1.15,
                   repetition_context_size=128)

WORKLOAD = [
    # (prompt length, params): greedy rows first, then sampled ones
    (14, SamplingParams(temperature=0.0, repetition_penalty=3.0, repetition_context_size=6,
                        max_tokens=30)),
    (21, SamplingParams(temperature=0.0, repetition_penalty=1.5, repetition_context_size=12,
                        max_tokens=26)),
    (9, SamplingParams(temperature=0.0, max_tokens=6)),  # no penalty, ends early
    (17, SamplingParams(**APP_DEFAULT, max_tokens=12, seed=11)),  # the widest window goes
    (25, SamplingParams(temperature=1.0, top_k=50, repetition_penalty=1.3,
                        repetition_context_size=12, max_tokens=22, seed=5, n=3)),
    (12, SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=2.0,
                        repetition_context_size=6, max_tokens=40, seed=9, stop=("e",))),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama",
                           reference_model().path)


def prompt_of(length: int, salt: int) -> list[int]:
    return [(97 * i + 31 * salt + 7) % 30000 + 200 for i in range(length)]


def run(folder: Path, overlap: bool, num_blocks: int) -> tuple[dict, dict]:
    eng = Engine(EngineConfig(model=str(folder), kv_memory_mib=budget_mib(num_blocks, BLOCK),
                              block_size=BLOCK, prefill_chunk=64, max_batch=16,
                              overlap=overlap, speculative=False))  # drafting rows run
    # synchronous steps (ARCHITECTURE §3.13): this file checks the overlap itself
    eng.start()
    try:
        assert eng.wait_ready(120), eng.load_error
        handles = [eng.submit(prompt_tokens=prompt_of(n, i), params=p, session_id=f"s{i}")
                   for i, (n, p) in enumerate(WORKLOAD)]
        results = {}
        for i, h in enumerate(handles):
            tokens, finals = collect(h)
            for index, final in finals.items():
                results[i, index] = (tokens.get(index, []), final.text, final.finish_reason)
        wait_until(lambda: eng.snapshot().used_blocks == 0)
        rt = eng.runtime
        stats = {"steps": rt.scheduler.steps, "ahead": rt.stepper.launched_ahead,
                 "preemptions": rt.scheduler.preemptions}
    finally:
        eng.stop()
    return results, stats


def greedy_reference(folder: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    """mlx-lm's own greedy generation with its repetition-penalty processor."""
    model, tokenizer = reference_copy(str(folder))
    processors = make_logits_processors(
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0
        else None, repetition_context_size=params.repetition_context_size)
    out = []
    for r in stream_generate(model, tokenizer, prompt, max_tokens=params.max_tokens,
                             logits_processors=processors):
        out.append(r.token)
        if r.finish_reason is not None:
            break
    return out


def sampled_reference(folder: Path, prompt: list[int], params: SamplingParams, index: int,
                      tokens: list[int]) -> list[int]:
    """The tokens the numpy oracle draws with the documented key stream, given the tokens
    actually drawn before each one (tests/reference.py's replay, on the tiny model)."""
    model, _ = reference_copy(str(folder))
    cache = make_prompt_cache(model)
    keys = key_stream(params.seed, index)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    history = list(prompt)
    expected = []
    for token in tokens:
        dist = oracle_distribution(np.array(logits.astype(mx.float32)), params, history)
        expected.append(oracle_draw(dist, next(keys)))
        history.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return expected


@pytest.mark.parametrize("num_blocks", [256, 14], ids=["roomy-pool", "preempting-pool"])
def test_overlapped_steps_with_penalties_seeds_stops_and_forks_equal_synchronous_ones(
        tiny: Path, num_blocks: int) -> None:
    synchronous, sync_stats = run(tiny, overlap=False, num_blocks=num_blocks)
    overlapped, stats = run(tiny, overlap=True, num_blocks=num_blocks)
    assert overlapped == synchronous
    assert len(overlapped) == sum(p.n for _, p in WORKLOAD)
    if num_blocks < 100:
        assert sync_stats["preemptions"] > 0 and stats["preemptions"] > 0
    # Overlap, penalised rows included: nearly every step was launched before the previous
    # step's tokens were read (not the first, nor steps after one that sampled nothing).
    assert sync_stats["ahead"] == 0
    assert stats["ahead"] >= 0.8 * stats["steps"], stats  # measured: 29 of 31, 47 of 49
    # ...and every sequence decoded in every step: overlapping took no more steps than
    # not (measured 31 vs 30, and 49 vs 46 preempting; a sequence that sat out every other
    # step, its next token in flight unseen by the scheduler, took 45 and 65).
    assert stats["steps"] <= 1.2 * sync_stats["steps"], (stats, sync_stats)

    # Right, not just equal: each reply against its independent reference.
    reasons = set()
    for (i, index), (tokens, text, reason) in overlapped.items():
        length, params = WORKLOAD[i]
        prompt = prompt_of(length, i)
        reasons.add(reason)
        assert reason is not FinishReason.ERROR
        if params.greedy:
            expected = greedy_reference(tiny, prompt, params)
            assert tokens == expected[: len(tokens)], f"reply {i}"
            assert reason is FinishReason.STOP or tokens == expected, f"reply {i}"
        else:
            assert tokens == sampled_reference(tiny, prompt, params, index, tokens), (
                f"reply {i} sample {index}")
        if params.stop:
            assert reason is FinishReason.STOP and "e" not in text
    assert len({tuple(overlapped[4, i][0]) for i in range(3)}) == 3  # the forks drew apart
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}


def test_the_workloads_penalties_change_its_greedy_replies(tiny: Path) -> None:
    """Without their penalties the penalised greedy replies differ: the references above
    tell a broken window from a working one."""
    for i in (0, 1):
        length, params = WORKLOAD[i]
        prompt = prompt_of(length, i)
        plain = SamplingParams(temperature=0.0, max_tokens=params.max_tokens)
        assert greedy_reference(tiny, prompt, params) != greedy_reference(tiny, prompt, plain)


def test_a_step_rerun_after_the_next_was_launched_keeps_every_stream(tiny: Path,
                                                                      monkeypatch) -> None:
    """A step whose read fails is rerun one sequence at a time, while the step after it is
    already launched with the carried windows and keys. The rerun draws with the keys the
    failed step drew with, must not take back the keys the launched step moved on, and the
    steps after it rebuild their state from the host: the replies equal the synchronous
    engine's, seeded and penalised ones included."""
    synchronous, _ = run(tiny, overlap=False, num_blocks=256)
    real_read = step_module.StepRunner._read
    failed = []

    def read(runner, launched):
        if launched.number == 6 and not failed:
            assert runner.carry.last is not None and runner.carry.last.number == 7  # 7 is in flight
            failed.append(launched.number)
            runner._rerun(launched)  # as _read does when the device fails
            return
        real_read(runner, launched)

    monkeypatch.setattr(step_module.StepRunner, "_read", read)
    overlapped, _ = run(tiny, overlap=True, num_blocks=256)
    assert failed == [6]
    assert overlapped == synchronous
