"""Helpers to drive modal dialogs and menus the way a user does (click their buttons).

A modal dialog's exec() runs its own event loop, so the click is queued before the action
that opens it and runs inside that loop, once the dialog is the active modal widget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMenu, QWidget

POLL_MS = 20
GIVE_UP_MS = 20_000


def when_modal(handler: Callable[[QWidget], None], kind: type = QWidget) -> list[QWidget]:
    """Run `handler(dialog)` once a modal widget of `kind` is shown; returns the dialogs seen."""
    seen: list[QWidget] = []
    waited = [0]

    def check() -> None:
        w = QApplication.activeModalWidget()
        if isinstance(w, kind) and w.isVisible():
            seen.append(w)
            handler(w)
            return
        waited[0] += POLL_MS
        if waited[0] < GIVE_UP_MS:
            QTimer.singleShot(POLL_MS, check)

    QTimer.singleShot(0, check)
    return seen


def when_popup_menu(handler: Callable[[QMenu], None]) -> list[QMenu]:
    """Run `handler(menu)` once a popup menu is open (context menus block in exec())."""
    seen: list[QMenu] = []
    waited = [0]

    def check() -> None:
        w = QApplication.activePopupWidget()
        if isinstance(w, QMenu) and w.isVisible():
            seen.append(w)
            handler(w)
            return
        waited[0] += POLL_MS
        if waited[0] < GIVE_UP_MS:
            QTimer.singleShot(POLL_MS, check)

    QTimer.singleShot(0, check)
    return seen


def trigger_menu_item(menu: QMenu, text: str) -> None:
    for a in menu.actions():
        if a.text().replace("&", "") == text:
            menu.close()
            a.trigger()
            return
    menu.close()
    raise AssertionError(f"no menu item {text!r} in {[a.text() for a in menu.actions()]}")


def click_button(dialog: Any, text: str) -> None:
    from PySide6.QtWidgets import QAbstractButton

    for b in dialog.findChildren(QAbstractButton):
        if b.text().replace("&", "") == text and b.isVisible():
            b.click()
            return
    raise AssertionError(f"no button {text!r} in {dialog.metaObject().className()}")
