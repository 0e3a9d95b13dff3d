"""One name for a model everywhere: the toolbar, the panes, the Models window and the API.

The scheme: a model's name is its id, the same string in every place: the Hugging Face repo
id for a hub model ("mlx-community/Qwen3-0.6B-4bit"), the folder's name for a local folder,
"SmolLM2-135M-Instruct" for the built-in one; whitespace becomes "-", so the API's
/v1/models id has no spaces and can be typed as it is shown. How the weights are held (the
built-in runs as fp32 on the CPU and 4-bit on Metal) is a detail, never part of the name: it
shows as "weights: fp32" where details are shown (the toolbar's tooltip, the Models window's
Quantization column).

The engine names the built-in model "SmolLM2-135M-Instruct (fp32)" (engine/models/default_model.py);
`model_id` and `weights` take that apart here, since the engine's ModelInfo has no separate
field for it yet.
"""

from __future__ import annotations

import re

from engine import DEFAULT_MODEL_NAME

_VARIANT = re.compile(rf"^{re.escape(DEFAULT_MODEL_NAME)} \((?P<weights>[^()]+)\)$")


def model_id(engine_name: str) -> str:
    """The model's one name (and API id) from the name the engine reports."""
    match = _VARIANT.match(engine_name.strip())
    name = DEFAULT_MODEL_NAME if match else engine_name
    return "-".join(name.split())


def weights(engine_name: str) -> str:
    """How the weights are held ("fp32", "4-bit"), when the engine's name says it; else ""."""
    match = _VARIANT.match(engine_name.strip())
    return match.group("weights") if match else ""
