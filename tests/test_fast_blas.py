"""The `pagedchat` entry point itself gives MLX Debian's OpenBLAS on Linux (issue 25, item 2).

Started from the virtual environment's script (not `run.sh`, so no `LD_PRELOAD`), the app
and `pagedchat serve` load OpenBLAS before MLX (app/core/openblas.py); where they cannot, the
window and the server say why prompts are slow. The processes here are the real console
script, run with this checkout first on the path, and bounded in time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.core import openblas

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "pagedchat"
HAS_OPENBLAS = sys.platform.startswith("linux") and any(
    os.path.isfile(p) for p in openblas.OPENBLAS_OPENMP)
needs_openblas = pytest.mark.skipif(not HAS_OPENBLAS, reason="Linux with libopenblas0-openmp")


def entry_point_env(**extra: str) -> dict[str, str]:
    """A user's shell: no LD_PRELOAD (that is run.sh's doing), this checkout's code."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", openblas.OPT_OUT, "DISPLAY", "WAYLAND_DISPLAY")}
    env["PYTHONPATH"] = str(ROOT)
    env["QT_QPA_PLATFORM"] = "offscreen"
    env.update(extra)
    return env


def openblas_mapped(pid: int) -> bool:
    """Seen from outside the process: is Debian's OpenBLAS in its memory map?"""
    return "openblas-openmp/libopenblas" in Path(f"/proc/{pid}/maps").read_text()


@needs_openblas
@pytest.mark.model
@pytest.mark.slow
def test_the_entry_point_runs_mlx_on_openblas_without_ld_preload() -> None:
    run = subprocess.run([str(SCRIPT), "--self-test"], capture_output=True, text=True,
                         timeout=600, env=entry_point_env(), cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cpu, openblas," in run.stdout, run.stdout


@needs_openblas
@pytest.mark.model
@pytest.mark.slow
def test_pagedchat_serve_loads_openblas_and_says_nothing_about_speed() -> None:
    from tests.test_server_cli import SERVE_TIMEOUT_S, Lines

    proc = subprocess.Popen(
        [str(SCRIPT), "serve", "--port", "0", "--kv-memory-mib", "16", "--api-key", "k"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=entry_point_env(), cwd=ROOT)
    try:
        out = Lines(proc.stdout)
        out.wait_for(r"at http://127\.0\.0\.1:\d+/v1", SERVE_TIMEOUT_S)
        out.wait_for(r"API key: from", 10)  # the line after any speed warning
        assert openblas_mapped(proc.pid)
        assert not any("WARNING" in line for line in out.lines), out.lines
    finally:
        proc.terminate()
        proc.wait(60)


@needs_openblas
def test_an_opted_out_entry_point_says_why_it_is_slow() -> None:
    """PAGEDCHAT_NO_OPENBLAS=1: no OpenBLAS in the process, and the reason in words."""
    code = ("from app.core import openblas\n"
            "s = openblas.load()\n"
            "import mlx.core, os\n"
            "maps = open(f'/proc/{os.getpid()}/maps').read()\n"
            "print(s.label, 'openblas-openmp' in maps)\n"
            "print(s.problem)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=entry_point_env(**{openblas.OPT_OUT: "1"}), cwd=ROOT)
    assert run.returncode == 0, run.stderr
    first, problem = run.stdout.splitlines()
    assert first == "bundled blas False"
    assert openblas.OPT_OUT in problem and "slow" in problem


@needs_openblas
@pytest.mark.parametrize("policy", [None, "ACTIVE"])
def test_the_entry_point_lets_openblas_threads_sleep_unless_the_user_chose(policy) -> None:
    """The loader sets OMP_WAIT_POLICY=PASSIVE before OpenBLAS (and its libgomp) loads, so the
    CPU attention kernel may split small calls over the cores; a policy the user set stays,
    and the kernel then keeps small calls on one thread (engine/attention/cpu_kernel.py)."""
    code = ("from app.core import openblas\n"
            "s = openblas.load()\n"
            "import os\n"
            "from engine.attention import cpu_kernel\n"
            "print(s.label, os.environ.get('OMP_WAIT_POLICY'), cpu_kernel.THREAD_MIN_COST)\n")
    env = entry_point_env()
    env.pop(openblas.WAIT_POLICY, None)
    env.pop("GOMP_SPINCOUNT", None)
    if policy:
        env[openblas.WAIT_POLICY] = policy
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    from engine.attention import cpu_kernel
    expected = (f"openblas PASSIVE {cpu_kernel.THREAD_MIN_COST_SLEEPING}" if policy is None
                else f"openblas ACTIVE {cpu_kernel.THREAD_MIN_COST_SPINNING}")
    assert run.stdout.strip() == expected


def test_the_window_says_why_prompts_are_slow(qtbot, app_env, monkeypatch) -> None:
    from app.core.store import Store
    from tests.app_helpers import engineless_window

    slow = openblas.BlasState(relevant=True, problem="MLX is running on its slow bundled BLAS")
    monkeypatch.setattr(openblas, "_state", slow)
    with engineless_window(qtbot, Store(app_env)) as w:
        banner = w.speed_banner
        assert banner.isVisible() and banner.label.text() == slow.problem
        qtbot.mouseClick(banner.dismiss, Qt.MouseButton.LeftButton)
        assert not banner.isVisible()


def test_a_fast_window_shows_no_speed_warning(qtbot, app_env, monkeypatch) -> None:
    from app.core.store import Store
    from tests.app_helpers import engineless_window

    fast = openblas.BlasState(relevant=True, library="/usr/lib/libopenblas.so.0", how="loaded")
    monkeypatch.setattr(openblas, "_state", fast)
    with engineless_window(qtbot, Store(app_env)) as w:
        assert not w.speed_banner.isVisible()

