"""Detect a machine with no display before Qt does (and prints its plugin error instead)."""

from __future__ import annotations

import os
import sys

MESSAGE = (
    "pagedchat: no display found (DISPLAY and WAYLAND_DISPLAY are not set): run it under "
    "xvfb-run, set QT_QPA_PLATFORM=offscreen, or use --demo --screenshot FILE"
)


def no_display_problem(
    environ: dict[str, str] | None = None, platform: str | None = None
) -> str | None:
    """The one-line message to print when there is nowhere to show a window, else None."""
    env = os.environ if environ is None else environ
    plat = sys.platform if platform is None else platform
    if not plat.startswith("linux"):
        return None
    if env.get("QT_QPA_PLATFORM") or env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"):
        return None
    return MESSAGE
