"""Shared pytest fixtures. Sections are owned by different parts of the project: append,
never rewrite another section."""

from __future__ import annotations

import os

# ---- app (PySide6) fixtures ---------------------------------------------------------------
# Qt tests run without a display unless the caller chose a platform (e.g. xvfb-run); the
# offscreen screen is made 1920x1200 (its default, 800x800, clamps restored window sizes).
os.environ.setdefault(
    "QT_QPA_PLATFORM",
    "offscreen:configfile=" + os.path.join(os.path.dirname(__file__), "offscreen_screen.json"),
)

import pytest  # noqa: E402


@pytest.fixture
def restores_the_style():
    """A theme chosen in a test is undone after it (app-wide style, palette, stylesheet), so
    the tests after it see the window as it opens."""
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    style, palette, sheet = app.style().name(), app.palette(), app.styleSheet()
    yield
    app.setStyle(style)
    app.setPalette(palette)
    app.setStyleSheet(sheet)


@pytest.fixture
def app_env(tmp_path, monkeypatch):
    """A throw-away data folder, XDG_DATA_HOME and a real file keyring (keyrings.alt)."""
    import keyring.core

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("PYTHON_KEYRING_BACKEND", "keyrings.alt.file.PlaintextKeyring")
    # ...which the app refuses for real secrets unless the tests name it (app/core/secrets.py)
    monkeypatch.setenv("PAGEDCHAT_TEST_KEYRING", "keyrings.alt.file.PlaintextKeyring")
    keyring.core.init_backend()
    data = tmp_path / "data"
    data.mkdir()
    return data


@pytest.fixture(scope="session")
def _qasync_session_loop(qapp):
    """One qasync loop for the whole session (stopping it calls QApplication.exit(), after
    which Qt's nested event loops, and so pytest-qt's waits, return at once)."""
    import asyncio

    import qasync

    loop = qasync.QEventLoop(qapp, already_running=True)
    asyncio.events._set_running_loop(None)  # made current per module by qasync_loop
    yield loop
    loop.stop()
    loop.close()  # joins its worker threads (Qt aborts on a QThread destroyed while running)


@pytest.fixture(scope="module")
def qasync_loop(_qasync_session_loop):
    """The qasync loop, current and running (driven by pytest-qt's waits) for one module;
    other modules keep a clean asyncio state (asyncio.run works there)."""
    import asyncio

    loop = _qasync_session_loop
    asyncio.set_event_loop(loop)
    asyncio.events._set_running_loop(loop)
    yield loop
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop(None)


@pytest.fixture(scope="module")
def app_engine():
    """One real engine (the embedded default model) per test module, ready to serve."""
    from engine import Engine, EngineConfig

    # overlap=True: the suite runs the overlapped step a GPU user gets (the CPU default is off)
    engine = Engine(EngineConfig(model="default", kv_memory_mib=64.0, max_batch=8, overlap=True))
    engine.start()
    if not engine.wait_ready(600):
        pytest.fail(f"the default model did not load: {engine.load_error}")
    yield engine
    engine.stop()


# ---- engine fixtures -------------------------------------------------------------------------
@pytest.fixture(params=["cpu", "fused"])
def attention_formulation(request, monkeypatch):
    """The reference path's two formulations, both on this CPU: ``cpu`` (what the CPU backend
    runs, engine/attention/cpu_sdpa.py) and ``fused`` (``mx.fast.scaled_dot_product_attention``,
    what a GPU backend runs where no kernel does)."""
    import engine.attention.dispatch as dispatch

    on_cpu = request.param == "cpu"
    monkeypatch.setattr(dispatch, "on_cpu", lambda: on_cpu)
    return request.param
