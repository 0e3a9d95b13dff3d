"""Each architecture we claim runs on the paged pool with the logits of mlx-lm's own cache.

A tiny random-weight model per architecture; three ragged prompts prefilled in one step,
then 20 decode steps in one batch, against each prompt run alone through mlx-lm's KVCache.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes

from engine.kv.block_table import BlockTable
from engine.kv.blocks import BlockAllocator
from engine.kv.invariants import check_invariants
from engine.kv.pool import KVPool
from engine.runner.architecture import PROVEN_ARCHITECTURES, probe_kv_shape
from engine.runner.model_adapter import PagedModel
from engine.runner.step_batch import build_step_batch
from engine.sched.work import SequenceWork

VOCAB = 128
COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}
CONFIGS = {
    "llama": {"model_type": "llama", "tie_word_embeddings": False},
    "mistral": {"model_type": "mistral", "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},
    "phi3": {"model_type": "phi3", "num_key_value_heads": 1},
    "gemma": {"model_type": "gemma", "head_dim": 16, "num_key_value_heads": 1},
}
PROMPT_LENGTHS = (5, 17, 30)
DECODE_STEPS = 20
BLOCK_SIZE = 8


def tiny_model(arch: str):
    config = {**COMMON, **CONFIGS[arch]}
    model_class, args_class = _get_classes(config)
    mx.random.seed(sum(map(ord, arch)))
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def reference_logits(model, prompt: list[int], continuation: list[int]) -> list[mx.array]:
    """Logits after the prompt, then after each continuation token, via mlx-lm's cache."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([prompt]), cache=cache)[0, -1]]
    for token in continuation:
        out.append(model(mx.array([[token]]), cache=cache)[0, -1])
    mx.eval(out)
    return out


def paged_logits(model, prompts: list[list[int]], continuations: list[list[int]]):
    pool_shape = probe_kv_shape(model)
    alloc = BlockAllocator(num_blocks=64, block_size=BLOCK_SIZE)
    pool = KVPool(pool_shape, alloc.num_blocks, BLOCK_SIZE)
    paged = PagedModel(model, pool)
    tables = [BlockTable(owner=f"s{i}") for i in range(len(prompts))]
    outputs: list[list[mx.array]] = [[] for _ in prompts]

    def step(feeds: list[list[int]]) -> None:
        work = []
        for table, tokens in zip(tables, feeds, strict=True):
            start = table.num_tokens
            result = alloc.append(table, tokens)
            work.append(SequenceWork(tokens, start, list(table.blocks), result.slots))
        logits = paged.forward(build_step_batch(work))
        mx.eval(logits)
        for table in tables:
            alloc.mark_computed(table)
        for i, row in enumerate(logits):
            outputs[i].append(row)

    step(prompts)
    for t in range(DECODE_STEPS):
        step([[c[t]] for c in continuations])
    check_invariants(alloc, tables)
    return outputs


@pytest.mark.parametrize("arch", PROVEN_ARCHITECTURES)
def test_paged_logits_match_mlx_lm_cache(arch: str) -> None:
    model = tiny_model(arch)
    rng = __import__("random").Random(arch)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]
    continuations = [[rng.randrange(VOCAB) for _ in range(DECODE_STEPS)] for _ in prompts]
    expected = [reference_logits(model, p, c) for p, c in zip(prompts, continuations)]
    got = paged_logits(model, prompts, continuations)
    for seq in range(len(prompts)):
        for t, (e, g) in enumerate(zip(expected[seq], got[seq], strict=True)):
            diff = mx.abs(e - g).max().item()
            scale = mx.abs(e).max().item()
            assert diff <= 1e-4 * max(1.0, scale), f"{arch} seq {seq} step {t}: max diff {diff}"


def test_a_corrupted_block_table_breaks_the_match() -> None:
    """The comparison is sharp enough to see one wrong block-table entry."""
    model = tiny_model("llama")
    prompt = list(range(3, 3 + 2 * BLOCK_SIZE + 3))
    expected = reference_logits(model, prompt, [7])
    pool = KVPool(probe_kv_shape(model), 16, BLOCK_SIZE)
    alloc = BlockAllocator(16, BLOCK_SIZE)
    paged = PagedModel(model, pool)
    table = BlockTable(owner="s")
    result = alloc.append(table, prompt)
    paged.forward(build_step_batch([SequenceWork(prompt, 0, table.blocks, result.slots)]))
    alloc.mark_computed(table)
    result = alloc.append(table, [7])
    wrong = list(table.blocks)
    wrong[1] = alloc.num_blocks - 1  # a block that holds nothing
    logits = paged.forward(build_step_batch([SequenceWork([7], len(prompt), wrong, result.slots)]))
    assert mx.abs(logits[0] - expected[1]).max().item() > 1e-3


def test_load_time_check_accepts_a_compatible_architecture_and_flags_an_incompatible_one():
    """Outside the proven list the engine checks the paged path against mlx-lm at load time:
    a compatible architecture (starcoder2) agrees; gemma2, whose attention bypasses
    scaled_dot_product_attention (logit soft-capping), does not. Both sit far from the
    engine's fp32 threshold (1e-3): the Engine-level test below runs the real refusal."""
    from engine.runner.architecture import check_paged_matches

    CONFIGS.update(UNPROVEN)
    try:
        errors = {}
        for arch in UNPROVEN:
            model = tiny_model(arch)
            errors[arch] = check_paged_matches(model, probe_kv_shape(model), BLOCK_SIZE)
        assert errors["starcoder2"] < 1e-5 and errors["gemma2"] > 1e-2, errors
    finally:
        for arch in UNPROVEN:
            del CONFIGS[arch]


# ---- the load-time check, through the Engine ------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_model_folder(folder, arch: str):
    """A loadable mlx-lm folder: a tiny random-weight ``arch`` model with the default model's
    tokenizer (the vocabulary sized to match)."""
    import json
    import shutil

    from engine.models.default_model import converted_folder, locate_default_gguf
    from engine.models.gguf_cache import ensure_converted

    source = ensure_converted(locate_default_gguf(), converted_folder(False), quantized=False)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = {**COMMON, **CONFIGS[arch], "vocab_size": vocab}
    model_class, args_class = _get_classes(config)
    mx.random.seed(sum(map(ord, arch)))
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    model.save_weights(str(folder / "model.safetensors"))
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder


UNPROVEN = {
    "starcoder2": {"model_type": "starcoder2", "norm_epsilon": 1e-5},
    # soft-capped attention logits: bypasses scaled_dot_product_attention, so paged is wrong
    "gemma2": {"model_type": "gemma2", "head_dim": 16, "num_key_value_heads": 2,
               "query_pre_attn_scalar": 16},
}


@pytest.mark.parametrize("arch,accepted", [("starcoder2", True), ("gemma2", False)])
def test_engine_verifies_an_unproven_architecture_when_it_loads(tmp_path, arch, accepted):
    """Engine._verify_architecture with the engine's own threshold: starcoder2 agrees with
    mlx-lm and serves paged; gemma2 disagrees, so it is not run paged (never run wrongly) but
    on the fallback engine, mlx-lm's own BatchGenerator (engine/runner/fallback.py), and its
    ModelInfo says why. Either way the greedy reply equals mlx-lm's own generation."""
    from engine import Engine, EngineConfig, FinishReason, SamplingParams
    from tests.reference import collect
    from tests.tiny_model import mlx_lm_greedy

    assert arch not in PROVEN_ARCHITECTURES
    CONFIGS[arch] = UNPROVEN[arch]
    try:
        folder = tiny_model_folder(tmp_path / arch, arch)
    finally:
        del CONFIGS[arch]
    engine = Engine(EngineConfig(model=str(folder), kv_memory_mib=8, block_size=BLOCK_SIZE))
    engine.start()
    try:
        ready = engine.wait_ready(300)
        load_error, info = engine.load_error, engine.model_info
        prompt = [(5 * i + 7) % 97 + 3 for i in range(2 * BLOCK_SIZE + 5)]
        params = SamplingParams(temperature=0.0, max_tokens=10)
        tokens, finals = collect(engine.submit(prompt_tokens=prompt, params=params,
                                               session_id=arch))
        snap = engine.snapshot()
    finally:
        engine.stop()
    assert ready and info.model_type == arch, load_error
    assert info.paged is accepted and snap.paged is accepted
    if accepted:
        assert info.not_paged_reason == "" and info.num_blocks > 0
    else:
        assert f"the '{arch}' architecture does not run on PagedChat's paged KV pool" in \
            info.not_paged_reason
        assert "differs from mlx-lm's" in info.not_paged_reason
        assert info.attention == "mlx-lm" and snap.num_blocks == 0
    assert finals[0].finish_reason is not FinishReason.ERROR, finals[0].error
    assert tokens[0] == mlx_lm_greedy(folder, prompt, 10)
