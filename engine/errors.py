"""Errors shared by the loader, the architecture check and the GGUF converter (a module of
its own, so that they import it without importing each other)."""


class ModelLoadError(Exception):
    """A model could not be loaded; the message says why and what to do about it."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (hub and tokenizer errors run to many lines),
    for a ModelLoadError's one sentence."""
    text = str(error).strip()
    return text.splitlines()[0] if text else "no details"


class NotPaged(Exception):
    """Why a model cannot run on the paged pool: the engine then loads it on the fallback
    (engine/runner/fallback.py), mlx-lm's own batching, instead of refusing it."""
