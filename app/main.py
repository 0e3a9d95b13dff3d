"""PagedChat's entry point: `pagedchat` (see pyproject.toml).

Builds the QApplication and the qasync event loop, opens the app database, starts the engine
thread (the model loads in the background while the window shows its loading state), and on
quit stops every stream cleanly: partial replies are saved as interrupted, then the engine
thread is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

EXIT_NO_DISPLAY = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedchat",
        description="Several local-LLM chats side by side, streaming from one paged KV pool.",
        epilog="`pagedchat serve --help`: the OpenAI-compatible API server, without a window. "
        "`pagedchat batch --help`: an OpenAI batch file (JSONL) through the engine.",
    )
    p.add_argument(
        "--model",
        metavar="SPEC",
        help="'default' (embedded SmolLM2), a local mlx-lm folder or a Hugging Face repo id; "
        "overrides the saved setting for this run",
    )
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="folder for chats and settings (default: the platform's app-data folder; "
        "with --demo: a temporary folder)",
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="open three panes side by side and stream a short prompt in each",
    )
    p.add_argument(
        "--screenshot",
        metavar="FILE",
        help="with --demo: when every reply is done, save a screenshot of the window and exit",
    )
    p.add_argument("--kv-memory-mib", type=float, metavar="MIB", help="KV pool budget for this run")
    p.add_argument("--theme", choices=("system", "light", "dark"), help="colour theme for this run")
    p.add_argument(
        "--self-test",
        action="store_true",
        help="load the default model, generate a few tokens, open and close the window off "
        "screen, print one line and exit 0 if all worked (checks an installed or bundled app)",
    )
    return p


def default_data_dir() -> Path:
    from PySide6.QtCore import QStandardPaths

    loc = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppDataLocation)
    return Path(loc) if loc else Path.home() / ".pagedchat"


GIL_SWITCH_INTERVAL_S = 0.001


def share_the_gil() -> None:
    """Let the GUI thread get the GIL back quickly while the engine thread runs Python.

    Every GIL-releasing call on the GUI thread (an SQLite write, many Qt calls) must wait for
    the engine thread to hand the GIL back, by default up to 5 ms each time; a handful of such
    calls in one event then stall the UI for tens of milliseconds (bench/gui_latency.py).
    """
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from app.core import openblas

    openblas.load()  # first, before anything imports MLX: fast CPU matmuls on Linux
    if argv[:1] == ["serve"]:  # headless: the API server only, no Qt imported on this path
        from app.server.cli import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["batch"]:  # headless: an OpenAI batch file through the engine, no Qt
        from app.server.batch_cli import main as batch_main

        return batch_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.self_test:
        from app.self_test import main as self_test_main

        return self_test_main()
    if args.screenshot and not args.demo:
        parser.error("--screenshot needs --demo")

    from app.ui.display import no_display_problem

    problem = no_display_problem()
    if problem:
        if args.demo and args.screenshot:
            os.environ["QT_QPA_PLATFORM"] = "offscreen"  # nothing to show: render off screen
        else:
            print(problem, file=sys.stderr)
            return EXIT_NO_DISPLAY

    import qasync
    from PySide6.QtWidgets import QApplication

    from app.bridges.engine_bridge import EngineBridge
    from app.core import secrets
    from app.core.app_settings import AppSettings, default_kv_cache_dir
    from app.startup.data_folder import claim, close_store, open_store
    from app.startup.single_instance import bring_to_front
    from app.ui.display import quiet_offscreen_warnings
    from app.ui.resources import app_icon
    from app.ui.theme import theme_manager
    from app.window.main_window import MainWindow

    quiet_offscreen_warnings()
    share_the_gil()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("PagedChat")
    app.setApplicationDisplayName("PagedChat")
    app.setDesktopFileName("pagedchat")
    app.setWindowIcon(app_icon())
    if sys.platform == "darwin":
        app.setQuitOnLastWindowClosed(False)  # Mac: the app stays in the Dock
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)

    if args.data_dir:
        data_dir = Path(args.data_dir).expanduser()
    elif args.demo:
        data_dir = Path(tempfile.mkdtemp(prefix="pagedchat-demo-"))
    else:
        data_dir = default_data_dir()
    guard, code = claim(data_dir)  # one instance per data folder
    if guard is None:
        loop.close()
        return code
    store = open_store(data_dir)
    if store is None:
        guard.release()
        loop.close()
        return 1

    settings = AppSettings.load(store)
    # Chats sleep on disk (§3.14): in the platform's cache folder, or beside a data folder
    # given on the command line (a separate profile, a demo, a test: its own cache).
    explicit = args.data_dir or args.demo
    settings.kv_cache_dir = str(data_dir / "kv-cache" if explicit else default_kv_cache_dir())
    if args.model:
        settings.set_model_spec(args.model)
    if args.kv_memory_mib:
        settings.kv_memory_mib = args.kv_memory_mib
    if args.theme:
        settings.theme = args.theme
    theme_manager().apply(settings.theme)

    bridge = EngineBridge()
    window = MainWindow(store, bridge, settings)
    window.show()
    guard.activationRequested.connect(lambda: bring_to_front(window))
    if sys.platform == "darwin":  # clicking the Dock icon brings the hidden window back
        from PySide6.QtCore import Qt

        app.applicationStateChanged.connect(
            lambda state: window.show()
            if state == Qt.ApplicationState.ApplicationActive and not window.isVisible()
            else None
        )

    invalid = settings.validate()
    if invalid:
        bridge.fail(invalid)
    else:
        secrets.export_hf_token()
        try:
            bridge.start(settings.engine_config())
        except ValueError as exc:
            bridge.fail(str(exc))

    demo_result: dict[str, int] = {}
    if args.demo:
        from app.demo import run_demo

        async def demo() -> None:
            demo_result["code"] = await run_demo(window, args.screenshot)
            if args.screenshot:
                app.exit(demo_result["code"])

        asyncio.ensure_future(demo())

    try:
        code = loop.run_forever()
    finally:
        window.shutdown_chats()
        bridge.shutdown()
        close_store(store)
        guard.release()
        loop.close()  # joins the loop's worker threads (else Qt aborts at exit)
    code = demo_result.get("code", code if isinstance(code, int) else 0)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
