"""Where windows go: detect a machine with no display before Qt does (and prints its plugin
error instead), and keep the offscreen platform's noise off stderr."""

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


def quiet_offscreen_warnings() -> None:
    """The offscreen platform warns about window hints it cannot honour; that is noise."""
    if os.environ.get("QT_QPA_PLATFORM") != "offscreen":
        return
    from PySide6.QtCore import qInstallMessageHandler

    def handler(_mode: object, _context: object, message: str) -> None:
        if "propagateSizeHints" not in message:
            print(message, file=sys.stderr)

    qInstallMessageHandler(handler)
