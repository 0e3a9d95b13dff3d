"""No step hands MLX an array with a zero-sized dimension.

MLX's CUDA backend fails such a launch when the step is evaluated
(``cudaGraphAddKernelNode(...) failed: invalid argument``): on the H200 every prompt longer
than one prefill chunk ended in an error, because a chunk that is not its prompt's last
wants no logits, and the step built and evaluated a zero-row LM head (logits [0, vocab]).
The CPU backend computes empty arrays without complaint, so these tests watch the shapes
themselves: every array the step runner evaluates, every batch the model adapter runs, and
the rows the final norm keeps. They fail on the code that broke the GPU.
"""

from __future__ import annotations

import types
from pathlib import Path

import mlx.core as mx
import pytest

import engine.runner.model_adapter as model_adapter
import engine.runner.step as step_module
from engine import Engine, EngineConfig, FinishReason, SamplingParams
from engine.attention.plans import checked_call
from tests.reference import collect, reference_model
from tests.tiny_model import budget_mib, greedy_with_margin, make_tiny_model

BLOCK = 8
CHUNK = 16  # the smallest prefill chunk for 8-token blocks: every prompt below spans chunks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama",
                           reference_model().path)


def _arrays(value):
    if isinstance(value, mx.array):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _arrays(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _arrays(item)


class ShapeWatch:
    """Records every zero-sized shape the engine hands MLX at the points a step meets it."""

    def __init__(self) -> None:
        self.empty: list[str] = []
        self.evaluated = 0

    def check(self, where: str, *values) -> None:
        for a in _arrays(list(values)):
            if 0 in a.shape:
                self.empty.append(f"{where}: {a.shape}")

    def install(self, monkeypatch) -> None:
        real = step_module.mx

        def evaluating(name):
            def run(*args):
                self.evaluated += 1
                self.check(f"mx.{name}", *args)
                return getattr(real, name)(*args)
            return run

        proxy = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real)
                                         if not n.startswith("__")})
        proxy.eval = evaluating("eval")
        proxy.async_eval = evaluating("async_eval")
        monkeypatch.setattr(step_module, "mx", proxy)

        real_forward = model_adapter.PagedModel.forward

        def forward(paged, batch):
            self.check("step batch", batch.tokens, batch.positions, batch.write_blocks,
                       batch.write_offsets, batch.logit_rows, batch.decode_tables,
                       batch.decode_lens, [c.block_table for c in batch.prefills])
            logits = real_forward(paged, batch)
            self.check("logits", logits)
            return logits

        monkeypatch.setattr(model_adapter.PagedModel, "forward", forward)

        real_norm = model_adapter._RowSelectingNorm.__call__

        def norm(module, x):
            if module.rows is not None:
                self.check("final norm rows", module.rows, x[module.rows])
            return real_norm(module, x)

        monkeypatch.setattr(model_adapter._RowSelectingNorm, "__call__", norm)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
def test_prompts_over_one_chunk_never_hand_mlx_an_empty_array(tiny, monkeypatch, overlap):
    watch = ShapeWatch()
    watch.install(monkeypatch)
    prompts = {length: [(7 * i + length) % 4000 + 5 for i in range(length)]
               for length in (CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 100)}
    expected = {n: greedy_with_margin(tiny, p, 6)[0] for n, p in prompts.items()}
    eng = Engine(EngineConfig(model=str(tiny), kv_memory_mib=budget_mib(128, BLOCK),
                              block_size=BLOCK, prefill_chunk=CHUNK, prefill_target=0,
                              overlap=overlap))
    eng.start()
    try:
        assert eng.wait_ready(120), eng.load_error
        params = SamplingParams(temperature=0.0, max_tokens=6)
        handles = {n: eng.submit(prompt_tokens=p, params=params) for n, p in prompts.items()}
        for n, handle in handles.items():
            tokens, finals = collect(handle)
            assert finals[0].finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (
                n, finals[0])
            assert tokens[0] == expected[n], f"a {n}-token prompt diverged from mlx-lm"
    finally:
        eng.stop()
    assert watch.evaluated > 0
    assert watch.empty == [], f"zero-sized arrays reached MLX: {watch.empty[:5]}"


def test_a_chunk_run_alone_after_a_failed_step_writes_without_empty_logits(tiny, monkeypatch):
    """The isolation path (a failing step re-run one sequence at a time) evaluates a
    no-logits chunk on its own: the same zero-row shape must not appear there either."""
    watch = ShapeWatch()
    watch.install(monkeypatch)
    prompt = [(11 * i) % 4000 + 5 for i in range(3 * CHUNK + 3)]
    expected, _ = greedy_with_margin(tiny, prompt, 4)
    eng = Engine(EngineConfig(model=str(tiny), kv_memory_mib=budget_mib(64, BLOCK),
                              block_size=BLOCK, prefill_chunk=CHUNK, prefill_target=0,
                              overlap=False))
    eng.start()
    try:
        assert eng.wait_ready(120), eng.load_error
        runner = eng.runtime.stepper
        real_launch = runner._launch
        calls = {"n": 0}

        def launch_isolating(plan):  # every step goes through the one-at-a-time path
            calls["n"] += 1
            for work in plan.works:
                runner._run_alone(work, plan.fanout(work))
            return None

        monkeypatch.setattr(runner, "_launch", launch_isolating)
        handle = eng.submit(prompt_tokens=prompt,
                            params=SamplingParams(temperature=0.0, max_tokens=4))
        tokens, finals = collect(handle)
        monkeypatch.setattr(runner, "_launch", real_launch)
    finally:
        eng.stop()
    assert calls["n"] >= 4  # three no-logits chunks, then the last chunk and decodes
    assert finals[0].finish_reason in (FinishReason.STOP, FinishReason.LENGTH), finals[0]
    assert tokens[0] == expected
    assert watch.empty == [], f"zero-sized arrays reached MLX: {watch.empty[:5]}"


def test_kernels_refuse_an_empty_launch_by_name() -> None:
    """The kernels' own guard: a zero-row call is refused where it is made, with the
    shapes, instead of failing later inside a CUDA graph."""
    pool = mx.zeros((4, 8, 2, 64))
    with pytest.raises(ValueError, match="empty dimension"):
        checked_call(mx.zeros((0, 4, 1, 64)), pool, pool, mx.zeros((0, 2), dtype=mx.int32),
                     mx.zeros((0,), dtype=mx.int32))
    with pytest.raises(ValueError, match="empty dimension"):
        checked_call(mx.zeros((1, 4, 1, 64)), pool, pool, mx.zeros((1, 0), dtype=mx.int32),
                     mx.ones((1,), dtype=mx.int32))
