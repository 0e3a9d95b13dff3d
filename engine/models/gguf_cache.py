"""The cache of GGUF conversions: convert once, and never trust a half-written folder.

Converting the default model takes seconds and writes ~100-500 MB, so it runs on first use
only (engine/models/gguf.py does the conversion). A conversion is written to a temporary sibling
folder, renamed into place, and stamped last with what it was made from (converter
version, variant, source file, its size and mtime), so a folder that was interrupted, made
by another converter version or from another file is converted again instead of loaded.
Two processes converting at once both succeed; one folder is kept.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from engine.models import gguf as gguf_module

logger = logging.getLogger(__name__)

#: Bump whenever the conversion's output changes: cached folders with another stamp are
#: converted again instead of being trusted.
CONVERTER_VERSION = 2
STAMP_FILE = "pagedchat-conversion.json"
#: Files a finished conversion always holds (the stamp is written last).
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", STAMP_FILE)


def ensure_converted(gguf: Path, folder: Path, quantized: bool) -> Path:
    """Return ``folder`` holding a conversion of ``gguf``, converting only if it holds no
    valid one.

    The conversion is written to a temporary sibling folder and renamed into place, and the
    stamp is its last file, so a folder that is interrupted, from another converter version,
    or from another GGUF file is never trusted.
    """
    stamp = _conversion_stamp(gguf, quantized)
    if _is_valid_conversion(folder, stamp):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_folders(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        logger.info("Converting %s into %s (first use only)", gguf, folder)
        # Looked up on the module at each call: the tests replace it to count, copy or
        # interrupt conversions.
        gguf_module.convert_gguf(gguf, tmp, quantized)
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
