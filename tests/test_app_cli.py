"""The `pagedchat` command line: no-display message, and the demo screenshot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _headless_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        env.pop(key, None)
    return env


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux display check")
def test_no_display_prints_one_line_and_exits_2(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "app.main", "--data-dir", str(tmp_path)],
        cwd=ROOT,
        env=_headless_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "xvfb-run" in lines[0] and "QT_QPA_PLATFORM=offscreen" in lines[0]
    assert "--demo --screenshot" in lines[0] and "plugin" not in lines[0]
    assert not list(tmp_path.iterdir())  # nothing was created


def test_help_works_without_a_display():
    run = subprocess.run(
        [sys.executable, "-m", "app.main", "--help"],
        cwd=ROOT,
        env=_headless_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0
    for option in ("--model", "--data-dir", "--demo", "--screenshot", "--kv-memory-mib"):
        assert option in run.stdout


@pytest.mark.model
def test_demo_screenshot_without_a_display(tmp_path):
    shot = tmp_path / "shot.png"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.main",
            "--demo",
            "--screenshot",
            str(shot),
            "--data-dir",
            str(tmp_path / "data"),
            "--kv-memory-mib",
            "64",
        ],
        cwd=ROOT,
        env=_headless_env(),  # no display at all: --screenshot renders off screen
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]  # e.g. a slot run at exit
    from PySide6.QtGui import QImage

    image = QImage(str(shot))
    assert not image.isNull() and image.width() >= 1200 and image.height() >= 700
    # three chats were answered and saved
    import sqlite3

    con = sqlite3.connect(tmp_path / "data" / "pagedchat.sqlite3")
    rows = con.execute(
        "SELECT status, length(content) FROM messages WHERE role='assistant'"
    ).fetchall()
    assert len(rows) == 3 and all(s in ("complete", "length") and n > 0 for s, n in rows)
