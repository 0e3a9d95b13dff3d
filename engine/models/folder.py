"""Loading one mlx-lm model folder, with a clear message for each way a folder can be wrong.

Whatever a model spec names (the converted default, a local folder, a downloaded Hugging
Face snapshot), it ends as a folder loaded here, so the engine sees one kind of model: a
``LoadedModel``. The weights and the tokenizer are loaded apart (``mlx_lm.load`` does both)
so that a failure names the part that is wrong, and every failure the user can fix is a
``ModelLoadError`` with one sentence that names the fix; the original exception is chained
for the log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.errors import ModelLoadError, first_line

FALLBACK_CONTEXT = 4096
#: Config keys that hold a model's context limit, in the order architectures use them.
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "max_seq_len", "seq_length",
                "n_positions", "n_ctx", "model_max_length")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine.

    dtype is the compute dtype (what the embedding produces), which the KV pool must use so
    attention never mixes precisions or converts on every write.
    """

    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    name: str
    path: Path
    model_type: str
    max_context: int
    dtype: mx.Dtype


def load_folder(path: Path, name: str | None = None) -> LoadedModel:
    """Load an mlx-lm model folder, turning every expected failure into a ModelLoadError."""
    from mlx_lm.utils import load_model as load_weights

    config = _read_folder_config(path)
    model_type = config.get("model_type")
    if not model_type:
        raise ModelLoadError(f"{path / 'config.json'} has no model_type: it is not an mlx-lm "
                             "model folder. Convert the model with mlx_lm.convert first.")
    if not any(path.glob("model*.safetensors")):
        raise ModelLoadError(f"The model folder {path} has no weights (model*.safetensors). "
                             "Convert the model with mlx_lm.convert, or download it again.")
    try:
        # The weights and the tokenizer are loaded apart (mlx_lm.load does both) so that a
        # failure names the part that is wrong.
        model, config = load_weights(path)
    except ValueError as e:
        if "not supported" in str(e):
            raise ModelLoadError(
                f"Model type '{model_type}' (in {path}) is not supported by the installed "
                "mlx-lm: choose a model with a supported architecture (llama, qwen2, qwen3, "
                "mistral, phi3, gemma, ...) or upgrade mlx-lm.") from e
        raise ModelLoadError(f"Could not load the model in {path}: {e}. Its weights do not "
                             "match its config.json; convert it again with mlx_lm.convert.") from e
    except Exception as e:  # anything else is still a bad folder, not a crash
        raise ModelLoadError(f"Could not load the model in {path}: {type(e).__name__}: {e}. "
                             "Check that it is a complete mlx-lm folder.") from e
    tokenizer = _load_tokenizer(path, config)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name or path.name,
        path=path,
        model_type=str(model_type),
        max_context=context_limit(config),
        dtype=compute_dtype(model),
    )


#: Files one of which holds a tokenizer mlx-lm (transformers) can load without converting.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
TOKENIZER_FIX = ("copy the tokenizer files (tokenizer.json and tokenizer_config.json) of the "
                 "original model into it, or convert the model again with mlx_lm.convert, "
                 "which saves them")


def _load_tokenizer(path: Path, config: dict) -> Any:
    """The folder's tokenizer, or a ModelLoadError that says the tokenizer is the problem."""
    from mlx_lm.utils import load_tokenizer

    if not any((path / f).is_file() for f in TOKENIZER_FILES) and not any(
            path.glob("*.tiktoken")):
        raise ModelLoadError(f"The model folder {path} has no tokenizer (no tokenizer.json or "
                             f"tokenizer.model): {TOKENIZER_FIX}.")
    try:
        return load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        raise ModelLoadError(f"The tokenizer in {path} could not be loaded "
                             f"({type(e).__name__}: {first_line(e)}): {TOKENIZER_FIX}.") from e


def _read_folder_config(path: Path) -> dict:
    """The folder's config.json, or a ModelLoadError naming what is missing."""
    if not path.exists():
        raise ModelLoadError(f"Model folder not found: {path}. Check the path, or use "
                             "'default' for the built-in model.")
    if not path.is_dir():
        raise ModelLoadError(f"{path} is a file, not a model folder: pass the folder that "
                             "holds config.json and the weights.")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"The folder {path} has no config.json: it is not an mlx-lm "
                             "model folder. Convert the model with mlx_lm.convert first.")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{config_file} could not be read ({e}); restore or re-download "
                             "the model folder.") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_file} does not hold a JSON object; restore or "
                             "re-download the model folder.")
    return config


def context_limit(config: dict) -> int:
    """The model's context limit from its config (or its text_config), else 4096."""
    for cfg in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return FALLBACK_CONTEXT


def dtype_name(dtype: mx.Dtype) -> str:
    """"bfloat16" for mx.bfloat16: the spelling config.json files (and the UI) use."""
    return str(dtype).rpartition(".")[2]


def compute_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the model computes in: what its token embedding returns.

    A quantized embedding returns its scales' dtype, so the packed uint32 weights cannot be
    used for this; running the embedding on one token answers it for every kind.
    """
    for _, module in model.named_modules():
        if isinstance(module, nn.Embedding | nn.QuantizedEmbedding):
            return module(mx.array([0])).dtype
    floats = [v for _, v in _flat_parameters(model) if mx.issubdtype(v.dtype, mx.floating)]
    return floats[0].dtype if floats else mx.float32


def _flat_parameters(model: nn.Module) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())
