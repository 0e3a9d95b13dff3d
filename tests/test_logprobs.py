"""Log-probabilities of sampled tokens (engine/runner/logprobs.py) through the public API.

Reference: mlx-lm's model run over the prompt and the reply with its own KV cache, the
log-softmax of its logits at every position computed in float64 numpy: each reported
log-probability and its alternatives must match it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine import Engine, EngineConfig, SamplingParams
from tests.reference import chat_prompt, collect, greedy_reference, reference_model

pytestmark = pytest.mark.model

#: The paged forward and mlx-lm's own cache sum in another order: their fp32 log-softmaxes
#: differ by up to about 3e-4 over 30 layers (the default model); a wrong distribution (after
#: the temperature, the penalty or the filters) is off by far more.
LOGIT_TOL = 1e-3


def reference_logprobs(prompt: list[int], reply: list[int]) -> np.ndarray:
    """[len(reply), V] float64 log-softmax of mlx-lm's logits before each reply token."""
    ref = reference_model()
    cache = make_prompt_cache(ref.model)
    logits = ref.model(mx.array([prompt + reply[:-1]]), cache=cache)[0, len(prompt) - 1:]
    x = np.array(logits.astype(mx.float32), dtype=np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module", params=[False, True], ids=["synchronous", "overlapped"])
def engine(request):
    eng = Engine(EngineConfig(kv_memory_mib=64, max_batch=8, overlap=request.param))
    eng.start()
    assert eng.wait_ready(600), eng.load_error
    yield eng
    eng.stop()


def _entries(handle):
    entries, tokens = {}, {}
    for event in handle:
        if hasattr(event, "logprobs"):
            tokens.setdefault(event.index, []).extend(event.token_ids)
            entries.setdefault(event.index, []).extend(event.logprobs or ())
    return tokens, entries


def test_greedy_logprobs_and_alternatives_match_mlx_lm(engine):
    prompt = chat_prompt([{"role": "user", "content": "Name a large city in Japan."}])
    plain = engine.submit(prompt_tokens=prompt,
                          params=SamplingParams(temperature=0.0, max_tokens=16))
    tokens, entries = _entries(engine.submit(
        prompt_tokens=prompt, params=SamplingParams(temperature=0.0, max_tokens=16,
                                                    logprobs=5)))
    assert tokens[0] == greedy_reference(prompt, 16)  # asking for logprobs changes nothing
    assert collect(plain)[0][0] == tokens[0]  # nor does the other row in the batch
    want = reference_logprobs(prompt, tokens[0])
    eos = reference_model().tokenizer.eos_token_ids
    assert len(entries[0]) == len([t for t in tokens[0] if t not in eos])  # EOS has none
    for i, (token, entry) in enumerate(zip(tokens[0], entries[0])):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(want[i, token], abs=LOGIT_TOL)
        assert len(entry.top) == 5
        assert entry.top[0][0] == token  # greedy: the most likely is the one taken
        order = np.argsort(-want[i])[:5]
        np.testing.assert_allclose([v for _, v in entry.top], want[i, order], atol=LOGIT_TOL)
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)


def test_sampled_rows_report_the_model_distribution_not_the_filtered_one(engine):
    prompt = chat_prompt([{"role": "user", "content": "Write a line about rain."}])
    params = SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.3, max_tokens=20,
                            seed=11, n=2, logprobs=0)
    tokens, entries = _entries(engine.submit(prompt_tokens=prompt, params=params))
    for index in (0, 1):
        want = reference_logprobs(prompt, tokens[index])
        eos = reference_model().tokenizer.eos_token_ids
        assert len(entries[index]) == len([t for t in tokens[index] if t not in eos])
        for i, (token, entry) in enumerate(zip(tokens[index], entries[index])):
            assert entry.logprob == pytest.approx(want[i, token], abs=LOGIT_TOL)
            assert entry.top == ()


def test_a_bad_logprobs_count_is_refused_naming_it():
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(ValueError, match="logprobs must be None or an integer in"):
            SamplingParams(logprobs=bad)
