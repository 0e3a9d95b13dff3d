"""`PagedChat --self-test`: prove that an installed or frozen PagedChat actually works.

A bundle can build fine and still be broken: a data file left out (shaders, themes, the
embedded GGUF), a shared library missing (MLX's libmlx / mlx.metallib; a failed MLX load in a
bundle raises OSError, not ImportError), a Qt plugin missing, or numerics gone wrong. So the
self-test runs the same code paths a user's first launch runs, without a display and without
touching the user's chats:

1. resources: the app icon, both themes, the Metal shader source and the CPU kernel's source
   are found through the resource locators (app/ui/resources.py, engine/attention/plans.py)
   and the shader parses;
2. engine: the default model loads (converted into the cache folder on first use) and the
   paged engine answers a fixed question greedily through the public ``engine`` API, on
   the compiled CPU attention kernel where the backend is the CPU and a compiler exists;
3. window: the real main window opens off screen on a throw-away data folder, its engine
   bridge reports the model ready, and the window closes cleanly.

It prints one line (``PagedChat self-test: OK (...)`` or ``PagedChat self-test: FAILED:
reason``) and the exit code says the same, so CI and a Mac owner can check a build with one
command. The cache folder for the converted model must be writable: set PAGEDCHAT_CACHE_DIR to
a temporary folder in CI, or let it use the user's cache folder.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

#: A question whose greedy answer is known: a build with broken numerics (a wrong BLAS, a bad
#: conversion) still produces *some* text, so the answer itself is checked.
PROMPT = "What is the capital of France?"
EXPECTED = "Paris"
MAX_TOKENS = 8
LOAD_TIMEOUT_S = 900.0  # first run converts the GGUF; slow shared CI machines
GENERATE_TIMEOUT_S = 300.0
WINDOW_TIMEOUT_S = 60.0


class SelfTestError(Exception):
    """One step of the self-test failed; the message says which and why."""


@dataclass
class SelfTestResult:
    """What the self-test found; ``line()`` is the one line printed for it."""

    ok: bool = False
    reason: str = ""
    model: str = ""
    backend: str = ""
    tokens: int = 0
    seconds: float = 0.0
    text: str = ""
    window: bool = False
    frozen: bool = field(default_factory=lambda: bool(getattr(sys, "frozen", False)))

    def line(self) -> str:
        if not self.ok:
            return f"PagedChat self-test: FAILED: {self.reason}"
        where = "frozen" if self.frozen else "source"
        return (
            f"PagedChat self-test: OK (model {self.model}, {self.backend}, {self.tokens} tokens "
            f"in {self.seconds:.1f} s, window ok, {where})"
        )


def check_resources() -> None:
    """Every file the app and the engine read at run time is where the locators look."""
    from app.ui.resources import app_icon_path, resources_dir
    from engine.attention import cpu_kernel
    from engine.attention import metal as kernels

    missing = [
        str(p)
        for p in (resources_dir() / "light.qss", resources_dir() / "dark.qss", kernels.SHADER_PATH,
                  cpu_kernel.SOURCE_PATH)
        if not p.is_file()
    ]
    if app_icon_path() is None:
        missing.append(str(resources_dir() / "icon.*"))
    if missing:
        raise SelfTestError(f"resources missing: {', '.join(missing)}")
    try:
        kernels.KERNELS.sources()
    except (OSError, ValueError) as e:
        raise SelfTestError(f"the Metal shader {kernels.SHADER_PATH} is unusable: {e}") from e


def check_attention(result: SelfTestResult, info) -> None:
    """Name the attention path in the result; on the CPU backend, where a C++ compiler is
    installed, it must be the compiled kernel: the MLX formulation there means the kernel's
    source or its build went missing (a frozen bundle once shipped without the source and
    ran 1.8-2.8x slower prompt chunks with nothing failing)."""
    attention = getattr(info, "attention", "?")
    result.backend = f"{result.backend}, {attention}"
    if result.backend.startswith("cpu") and attention != "cpu-paged":
        from engine.attention import cpu_kernel

        cxx = cpu_kernel.compiler()
        if cxx is not None:
            raise SelfTestError(f"the CPU attention kernel is not in use ({attention}) though "
                                f"{cxx} is installed: see the log for why it did not build")


def check_constrained(engine) -> None:
    """A reply held to a grammar (llguidance's native library and its package data must
    have travelled with the bundle)."""
    from engine import Constraint, FinishReason, SamplingParams

    pattern = r"(yes|no)"
    handle = engine.submit(
        messages=[{"role": "user", "content": "Is water wet? Answer yes or no."}],
        params=SamplingParams(temperature=0.0, max_tokens=8,
                              constraint=Constraint("regex", pattern)),
        session_id="self-test",
    )
    (final,) = handle.result(GENERATE_TIMEOUT_S)
    if final.finish_reason is not FinishReason.STOP or final.text not in ("yes", "no"):
        raise SelfTestError(f"a constrained reply broke its grammar: {final.text!r} "
                            f"({final.finish_reason}, {final.error})")


def generate(result: SelfTestResult) -> object:
    """Load the default model and answer PROMPT greedily; returns the running engine."""
    import mlx.core as mx

    from engine import Engine, EngineConfig, FinishReason, SamplingParams

    if mx.metal.is_available():
        result.backend = "metal"
    else:  # on Linux, say which BLAS MLX's matmuls resolve to (app/core/openblas.py)
        from app.core import openblas

        result.backend = f"cpu, {openblas.state().label}"
    engine = Engine(EngineConfig(model="default", kv_memory_mib=16.0, max_batch=2))
    engine.start()
    try:
        if not engine.wait_ready(LOAD_TIMEOUT_S):
            raise SelfTestError(
                f"the default model did not load: {engine.load_error or 'timed out'}"
            )
        result.model = engine.model_info.name if engine.model_info else "?"
        check_attention(result, engine.model_info)
        start = time.perf_counter()
        handle = engine.submit(
            messages=[{"role": "user", "content": PROMPT}],
            params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
            session_id="self-test",
        )
        try:
            (final,) = handle.result(GENERATE_TIMEOUT_S)
        except TimeoutError as e:
            handle.cancel()
            raise SelfTestError(f"no answer within {GENERATE_TIMEOUT_S:.0f} s") from e
        result.seconds = time.perf_counter() - start
        result.tokens = final.usage.generated_tokens
        result.text = final.text
        if final.finish_reason == FinishReason.ERROR:
            raise SelfTestError(f"generation failed: {final.error}")
        if not final.text.strip() or result.tokens == 0:
            raise SelfTestError("generation returned no text")
        if EXPECTED not in final.text:
            raise SelfTestError(
                f"wrong answer to {PROMPT!r}: {final.text!r} (numerics broken in this build?)"
            )
        check_constrained(engine)
    except BaseException:
        engine.stop()
        raise
    return engine


def open_window(engine: object) -> None:
    """Open the real main window off screen on ``engine``, wait until it shows the model ready,
    then close it the way quitting does."""
    import asyncio

    import qasync
    from PySide6.QtWidgets import QApplication

    from app.bridges.engine_bridge import EngineBridge
    from app.core.app_settings import AppSettings
    from app.core.store import Store
    from app.startup.data_folder import claim
    from app.ui.resources import app_icon
    from app.ui.theme import theme_manager
    from app.window.main_window import MainWindow
    from engine import EngineStatus

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("PagedChat")
    if app.windowIcon().isNull():
        app.setWindowIcon(app_icon())
    if app_icon().pixmap(64, 64).isNull():
        raise SelfTestError("the app icon does not render (Qt image plugin missing?)")
    theme_manager().apply("system")

    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    with tempfile.TemporaryDirectory(prefix="pagedchat-selftest-") as data_dir:
        guard, _ = claim(Path(data_dir))  # as a launch does: QLockFile + QLocalServer (QtNetwork)
        if guard is None:
            raise SelfTestError("the data folder could not be claimed (lock file / local server)")
        store = Store(data_dir)
        bridge = EngineBridge(engine=engine)  # wraps the engine; never stops it
        window = MainWindow(store, bridge, AppSettings.load(store))
        try:
            window.show()

            async def until_ready() -> str:
                deadline = time.monotonic() + WINDOW_TIMEOUT_S
                done = (EngineStatus.READY, EngineStatus.ERROR)
                while bridge.status not in done and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                return bridge.status

            status = loop.run_until_complete(until_ready())
            if not window.isVisible():
                raise SelfTestError("the main window did not show")
            if status != EngineStatus.READY:
                raise SelfTestError(f"the window's engine status is {status!r}, not 'ready'")
            if window.grab().isNull():
                raise SelfTestError("the main window did not render")
        finally:
            window.shutdown_chats()
            window.close()
            bridge.shutdown()
            store.close()
            guard.release()
            app.processEvents()
            loop.close()  # joins the loop's worker threads (else Qt aborts at exit)
            asyncio.set_event_loop(None)


def run_self_test() -> SelfTestResult:
    """Run every check; never raises for a failed check (the result says what failed)."""
    # No platform chosen: never pop up a window (and work on a machine without a display).
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    result = SelfTestResult()
    engine = None
    try:
        check_resources()
        engine = generate(result)
        open_window(engine)
        result.window = True
        result.ok = True
    except SelfTestError as e:
        result.reason = str(e)
    except Exception as e:  # noqa: BLE001 - an unexpected crash is a failed test, with its cause
        traceback.print_exc()  # stderr: where in the bundle it broke
        result.reason = f"{type(e).__name__}: {e}"
    finally:
        if engine is not None:
            engine.stop()
    return result


def main() -> int:
    """Entry for ``pagedchat --self-test``: print the one-line result, return the exit code."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from app.ui.display import quiet_offscreen_warnings

    quiet_offscreen_warnings()
    result = run_self_test()
    print(result.line(), flush=True)
    return 0 if result.ok else 1
