"""Taking the data folder at launch: one instance per folder, a database that opens.

Everything here ends with a sentence the user can act on, on stderr and (with a real display)
in a dialog, never with a traceback: a second launch brings the first window forward, a
folder owned by a silent process or not writable says so, a damaged database is reported
with the path of the copy that was kept.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from app.core.store import Store, StoreOpenError
from app.startup.single_instance import SingleInstance


def tell(message: str) -> None:
    """A startup problem: one line on stderr, and a dialog when there is a screen to show it."""
    print(f"pagedchat: {message}", file=sys.stderr)
    if os.environ.get("QT_QPA_PLATFORM", "").split(":")[0] in ("offscreen", "minimal"):
        return
    from PySide6.QtWidgets import QApplication, QMessageBox

    if QApplication.instance() is not None:
        QMessageBox.critical(None, "PagedChat", message)


def claim(data_dir: Path) -> tuple[SingleInstance | None, int]:
    """(the folder's guard, 0) to go on, or (None, exit code) when this launch must stop."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        tell(f"The data folder {data_dir} cannot be created: {exc.strerror or exc}.")
        return None, 1
    guard = SingleInstance(data_dir)
    why = guard.acquire()
    if why is None:
        return guard, 0
    if why == "held":
        if guard.ask_running_instance():
            print(
                f"pagedchat: PagedChat is already open with the data folder {data_dir}; "
                "its window was brought to the front.",
                file=sys.stderr,
            )
            return None, 0
        tell(
            f"The data folder {data_dir} is in use by another PagedChat ({guard.holder()}) "
            "that does not answer. Quit it, or start with --data-dir and another folder."
        )
        return None, 1
    tell(f"PagedChat cannot start: {why}.")
    return None, 1


def open_store(data_dir: Path) -> Store | None:
    """The store, or None after telling the user why it cannot be opened."""
    try:
        store = Store(data_dir)
    except StoreOpenError as exc:
        tell(str(exc))
        return None
    except Exception as exc:  # anything else still ends in a sentence
        tell(f"The data folder {data_dir} cannot be opened: {exc}.")
        return None
    if store.recovery is not None:
        print(f"pagedchat: {store.recovery.message()}", file=sys.stderr)
    return store


def close_store(store: Store) -> None:
    """Close, saying how much a fault that never passed kept from being saved."""
    store.close()
    if store.unsaved_at_close:
        problem = store.save_state.problem or "saving failed"
        print(
            f"pagedchat: {store.unsaved_at_close} change(s) could not be saved ({problem}).",
            file=sys.stderr,
        )
