"""The GPU bench measures against mlx-lm at its best, on the workload the app runs.

A win against a handicapped baseline is a bug in the bench: these tests fail if
``batch_generate`` is called with batch sizes other than n (its defaults, 32 and 8, decode
n = 64 as two batches and prefill in groups of 8), if the sampled workload stops being the
app's own default for a new chat, or if mlx-lm is not given the same sampler and penalty.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench import gpu_bench


def test_app_sampling_is_the_apps_default_for_a_new_chat() -> None:
    from app.core.generation_defaults import FALLBACK

    fields = {f.name for f in dataclasses.fields(FALLBACK)}
    assert set(gpu_bench.APP_SAMPLING) <= fields
    assert {k: getattr(FALLBACK, k) for k in gpu_bench.APP_SAMPLING} == gpu_bench.APP_SAMPLING
    params = gpu_bench.engine_params("app-sampling", 5)
    assert params.repetition_penalty == FALLBACK.repetition_penalty
    assert params.max_tokens == 5


@pytest.mark.parametrize("workload", gpu_bench.WORKLOADS)
def test_batch_generate_runs_one_batch_of_n_with_the_same_sampling(monkeypatch, workload):
    import mlx_lm

    calls = []

    class Response:
        token_ids = [[1, 2]] * 3

    def fake_batch_generate(model, tokenizer, prompts, **kwargs):
        calls.append((len(prompts), kwargs))
        return Response()

    monkeypatch.setattr(mlx_lm, "batch_generate", fake_batch_generate)
    loaded = dataclasses.make_dataclass("Loaded", ["model", "tokenizer"])(None, None)
    gpu_bench.mlx_generate(loaded, [[5, 6]] * 3, 4, workload)
    (n, kwargs), = calls
    assert kwargs["completion_batch_size"] == kwargs["prefill_batch_size"] == n == 3
    if workload == "greedy":
        assert "sampler" not in kwargs and "logits_processors" not in kwargs
    else:
        assert callable(kwargs["sampler"]) and len(kwargs["logits_processors"]) == 1


@pytest.mark.slow
def test_the_gpu_bench_runs_end_to_end_at_quick_sizes(tmp_path) -> None:
    import engine.loading as loading

    real_load = loading.load_model
    out = tmp_path / "gpu.md"
    raw = tmp_path / "gpu.json"
    gpu_bench.main(["--quick", "--parts", "throughput,paste", "--repeats", "1",
                    "--paste-warmup", "--fresh-budget", "--fresh-sessions",
                    "--out", str(out), "--json", str(raw)])
    text = out.read_text()
    assert "| tiny | 4 | app-sampling |" in text
    assert "short chat's first token" in text
    paste = json.loads(raw.read_text())["paste"]
    assert paste["warm_scenario"] and len(paste["runs"]["traces"]) == 1  # each repeat's trace
    assert paste["fresh_budget"] and paste["fresh_sessions"]
    assert any(e[0] == "budget" for e in paste["runs"]["trace"])
    assert loading.load_model is real_load, "the bench left its in-memory loader behind"
