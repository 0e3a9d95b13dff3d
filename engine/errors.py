"""Errors shared by the loader and the GGUF converter (a module of its own, so that both
import it without importing each other)."""


class ModelLoadError(Exception):
    """A model could not be loaded; the message says why and what to do about it."""
