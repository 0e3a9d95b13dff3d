"""A tiny random-weight llama saved as an ordinary mlx-lm folder, with the default model's
real tokenizer and chat template.

Loading and stepping it takes milliseconds, so engine tests that restart the engine or run
hundreds of examples stay fast; greedy references come from mlx-lm's own generation on the
same folder, loaded separately.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")

CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,  # the SmolLM2 tokenizer's
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: K and V of one token in every layer, in bytes (fp32): what one pool slot costs.
BYTES_PER_TOKEN = 2 * CONFIG["num_hidden_layers"] * CONFIG["num_key_value_heads"] * 16 * 4


def budget_mib(num_blocks: int, block_size: int) -> float:
    """The kv_memory_mib that gives exactly ``num_blocks`` blocks for this model."""
    return num_blocks * block_size * BYTES_PER_TOKEN / 2**20


#: A tiny Gemma 3 (text): its sliding-window layers (a window of 8 here) disagree with the
#: paged path, so it fails the paged check and runs on the fallback engine
#: (engine/runner/fallback.py). (gemma2 fails the check too, but mlx-lm's own batching breaks on it:
#: its attention mask does not broadcast over a batch of ragged prompts.)
GEMMA3 = {**CONFIG, "model_type": "gemma3_text", "sliding_window": 8,
          "sliding_window_pattern": 2, "query_pre_attn_scalar": 16}

#: A tiny gemma2 (soft-capped attention logits): refused by the paged check, and mlx-lm's own
#: batching fails on it, so the fallback serves it one row at a time.
GEMMA2 = {**CONFIG, "model_type": "gemma2", "query_pre_attn_scalar": 16}


def make_tiny_model(folder: Path, tokenizer_folder: Path, seed: int = 0,
                    config: dict | None = None, dtype: mx.Dtype | None = None) -> Path:
    """Write the tiny model into ``folder`` (tokenizer copied from ``tokenizer_folder``);
    ``config`` replaces the llama config, ``dtype`` casts the weights (saved as mlx-lm
    saves a converted model: safetensors in that dtype, ``torch_dtype`` in config.json)."""
    config = dict(config or CONFIG)
    folder.mkdir(parents=True, exist_ok=True)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    if dtype is not None:
        model.set_dtype(dtype)
        config["torch_dtype"] = str(dtype).rpartition(".")[2]
    mx.eval(model.parameters())
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for name in TOKENIZER_FILES:
        if (tokenizer_folder / name).is_file():
            shutil.copy(tokenizer_folder / name, folder / name)
    return folder


@functools.lru_cache(maxsize=4)
def reference_copy(folder: str):
    """A separate instance of the folder's model and tokenizer (mlx-lm's own loader)."""
    import mlx_lm

    return mlx_lm.load(folder)


def greedy_with_margin(folder: Path, prompt: list[int], max_tokens: int
                       ) -> tuple[list[int], float]:
    """mlx-lm's greedy continuation of ``prompt`` on its own KV cache (stopping at EOS, which
    is included, as the engine streams it), and the smallest gap between the two best
    logits on the way: a test that compares greedy outputs needs no near-ties."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = reference_copy(str(folder))
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out: list[int] = []
    margin = float("inf")
    for _ in range(max_tokens):
        top2 = mx.topk(logits.astype(mx.float32), 2)
        token = int(mx.argmax(logits).item())
        margin = min(margin, abs(float(top2[1].item()) - float(top2[0].item())))
        out.append(token)
        if token in tokenizer.eos_token_ids:
            break
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return out, margin


def mlx_lm_greedy(folder: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy generation on the folder (``stream_generate``; it stops at EOS,
    which is included, as the engine streams it)."""
    from mlx_lm import stream_generate

    model, tokenizer = reference_copy(str(folder))
    out = []
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        out.append(r.token)
        if r.finish_reason is not None:
            break
    return out
