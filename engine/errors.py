"""Errors shared by the loader and the GGUF converter (a module of its own, so that both
import it without importing each other)."""


class ModelLoadError(Exception):
    """A model could not be loaded; the message says why and what to do about it."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (hub and tokenizer errors run to many lines),
    for a ModelLoadError's one sentence."""
    text = str(error).strip()
    return text.splitlines()[0] if text else "no details"
