"""Describing models on disk without loading them (app/core/model_catalog.py).

Each figure is checked against an independent source: the parameter count against the
arrays of the model mlx-lm builds (before quantization), the quantization against what
mlx_lm's own quantize_model wrote into config.json, the size against the files.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, quantize_model

from app.core import model_catalog
from tests.reference import reference_model
from tests.tiny_model import CONFIG, make_tiny_model


def fp32_parameters() -> int:
    model_class, args_class = _get_classes(CONFIG)
    model = model_class(args_class.from_dict(CONFIG))
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def quantized_folder(folder: Path) -> Path:
    """The tiny llama quantized by mlx-lm itself (4 bits, groups of 32), saved as
    mlx_lm.convert saves a quantized model: packed weights + scales + biases, and a
    "quantization" entry in config.json."""
    model_class, args_class = _get_classes(CONFIG)
    model = model_class(args_class.from_dict(CONFIG))
    model, config = quantize_model(model, dict(CONFIG), group_size=32, bits=4)
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"),
                        dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_plain_folder_is_described_from_its_files(tmp_path):
    folder = make_tiny_model(tmp_path / "tiny", reference_model().path)
    m = model_catalog.describe_folder(folder, model_catalog.FOLDER)
    assert m is not None
    assert (m.architecture, m.quantization, m.context, m.paged) == ("llama", "fp32", 512, "yes")
    assert m.parameters == fp32_parameters()
    assert m.size_bytes == sum(p.stat().st_size for p in folder.iterdir())


def test_a_quantized_model_counts_its_unpacked_parameters(tmp_path):
    folder = quantized_folder(tmp_path / "q4")
    m = model_catalog.describe_folder(folder, model_catalog.FOLDER)
    assert m is not None and m.quantization == "4-bit (group 32)"
    assert m.parameters == fp32_parameters()
    header = model_catalog.safetensors_header(folder / "model.safetensors")
    assert any(k.endswith(".scales") for k in header)  # it really is packed


def test_folders_that_are_no_model_are_skipped(tmp_path):
    (tmp_path / "empty").mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text('{"model_type": "llama"}')
    bad_json = tmp_path / "bad"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    (bad_json / "model.safetensors").write_bytes(b"\0" * 16)
    for folder in ("empty", "no-weights", "bad"):
        assert model_catalog.describe_folder(tmp_path / folder, model_catalog.FOLDER) is None
    assert model_catalog.scan(tmp_path, [str(tmp_path / "bad")], hf_cache=False,
                              include_embedded=False) == []


def test_a_partial_download_is_not_listed(tmp_path):
    from app.core.downloads import MANIFEST

    folder = make_tiny_model(tmp_path / "owner--tiny", reference_model().path)
    assert [m.name for m in model_catalog.scan(tmp_path, [], hf_cache=False,
                                               include_embedded=False)] == ["owner/tiny"]
    (folder / MANIFEST).write_text("{}")
    assert model_catalog.scan(tmp_path, [], hf_cache=False, include_embedded=False) == []
