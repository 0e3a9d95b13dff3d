"""A scripted first session with the real app on a real X server (Xvfb), screenshots after
every step (issue 11). The steps and their checks are in tests/walkthrough_driver.py; this
test starts Xvfb on a free display, runs the app twice (first session, then a relaunch on the
same data), and fails when a step fails or anything writes a traceback to stderr.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parent.parent
PHASE_TIMEOUT_S = 1500


def _start_xvfb() -> tuple[subprocess.Popen, str]:
    """Xvfb picks a free display number itself (-displayfd) and tells us which."""
    r, w = os.pipe()
    proc = subprocess.Popen(
        ["Xvfb", "-displayfd", str(w), "-screen", "0", "1920x1200x24", "-nolisten", "tcp"],
        pass_fds=(w,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(w)
    number = b""
    with os.fdopen(r, "rb") as pipe:
        number = pipe.readline().strip()
    if not number:
        proc.kill()
        pytest.fail("Xvfb did not start")
    return proc, f":{number.decode()}"


@pytest.fixture
def display():
    if shutil.which("Xvfb") is None:
        pytest.fail("Xvfb is not installed (apt-get install xvfb): the walk-through needs it")
    proc, name = _start_xvfb()
    yield name
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _run_phase(phase: str, shots: Path, data: Path, display: str, tmp: Path) -> str:
    env = dict(os.environ)
    env.update(
        DISPLAY=display,
        QT_QPA_PLATFORM="xcb",
        XDG_DATA_HOME=str(tmp / "xdg"),
        XDG_RUNTIME_DIR=str(tmp / "run"),
        PYTHON_KEYRING_BACKEND="keyrings.alt.file.PlaintextKeyring",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    (tmp / "run").mkdir(mode=0o700, exist_ok=True)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tests.walkthrough_driver", phase, str(shots), str(data)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=PHASE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the {phase} walk-through ran past {PHASE_TIMEOUT_S} s:\n{exc.stdout}")
    log = f"--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    assert out.returncode == 0, f"the {phase} walk-through failed (rc {out.returncode})\n{log}"
    assert "Traceback" not in out.stderr, f"a traceback on stderr during {phase}\n{log}"
    assert "STEP FAILED" not in out.stdout, log
    return out.stdout


def test_a_first_session_walk_through(display, tmp_path):
    shots = Path(
        os.environ.get("PAGEDCHAT_WALKTHROUGH_DIR") or tmp_path / "walkthrough-screenshots"
    )
    data = tmp_path / "data"
    print(f"\nwalk-through screenshots: {shots}")
    first = _run_phase("first", shots, data, display, tmp_path)
    again = _run_phase("relaunch", shots, data, display, tmp_path)
    steps = [line for line in (first + again).splitlines() if line.startswith("STEP OK:")]
    names = sorted(p.name for p in shots.glob("*.png"))
    print("\n".join(steps))
    assert len(names) == len(steps) >= 20, names
    for expected in (
        "new-chat",
        "four-panes",
        "four-panes-1280x800",
        "restored-1280x800",
        "keyboard-shortcuts",
        "keyboard-only",
        "screen-reader-walk",
        "stopped",
        "regenerated",
        "edited",
        "tooltip-while-hovered",
        "timeline-readout",
        "branched",
        "deleted-streaming-chat",
        "small-800x600",
        "dark-theme",
        "relaunched",
    ):
        assert any(expected in n for n in names), (expected, names)
