"""Sampling defaults for new chats: the model's own, else ones a tiny model does not loop on.

The engine's SamplingParams defaults (temperature 0.7, no repetition penalty, 512 tokens) made
SmolLM2-135M repeat one word for minutes. A model folder that ships `generation_config.json`
(Hugging Face's file) says how it wants to be sampled; those values win. Without one, the
fallback is a low temperature with nucleus sampling and a mild repetition penalty over the last
128 tokens, checked on the default model by tests/test_app_defects_live.py (regenerate x3
does not loop). The window matters as much as the penalty: with mlx-lm's 20 tokens a looping
sentence longer than 20 tokens is never penalised (CI saw one sentence repeated 13 times);
with 128, 24 seeded replies on three prompts repeated no 3-word phrase more than 4 times,
against 8 with 20 tokens (docs/FACTS.md).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from engine import SamplingParams

FALLBACK = SamplingParams(temperature=0.3, top_p=0.9, repetition_penalty=1.15,
                          repetition_context_size=128, max_tokens=384)
FROM_MODEL = "the model's generation_config.json"
FROM_APP = "PagedChat's defaults (the model ships no generation_config.json)"

# generation_config.json key -> SamplingParams field
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def model_defaults(folder: str | Path | None) -> tuple[SamplingParams, str]:
    """(defaults, where they come from) for a model folder (None or "": the fallback)."""
    config = _read(folder)
    if config is None:
        return FALLBACK, FROM_APP
    out = FALLBACK
    found = False
    for key, name in _KEYS.items():
        if key not in config:
            continue
        try:
            candidate = dataclasses.replace(out, **{name: type(getattr(out, name))(config[key])})
        except (TypeError, ValueError):
            continue  # a value the engine would refuse: keep ours
        out, found = candidate, True
    if config.get("do_sample") is False:  # the model asks for greedy decoding
        out, found = dataclasses.replace(out, temperature=0.0), True
    return (out, FROM_MODEL) if found else (FALLBACK, FROM_APP)


def _read(folder: str | Path | None) -> dict[str, Any] | None:
    if not folder:
        return None
    path = Path(folder) / "generation_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe(params: SamplingParams) -> str:
    """One line for the settings dialogs."""
    temp = "greedy" if params.temperature == 0 else f"temperature {params.temperature:g}"
    parts = [temp]
    if params.top_p < 1.0:
        parts.append(f"top-p {params.top_p:g}")
    if params.top_k:
        parts.append(f"top-k {params.top_k}")
    if params.min_p:
        parts.append(f"min-p {params.min_p:g}")
    if params.repetition_penalty != 1.0:
        parts.append(f"repetition penalty {params.repetition_penalty:g} over the last "
                     f"{params.repetition_context_size} tokens")
    if params.beam_search:
        parts.append(f"best of {params.beam_width} (beam search)")
    parts.append(f"at most {params.max_tokens:,} tokens")
    return " · ".join(parts)
