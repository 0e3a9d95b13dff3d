"""Confirmation dialogs that name their destructive button after the action.

PySide6 6.12 has no `QMessageBox.StandardButton.Delete`, so a "Delete" button is added with
the destructive role; the dialog is a real QMessageBox that tests find and click.
"""

from __future__ import annotations

from PySide6.QtWidgets import QMessageBox, QWidget


def confirm_destructive(parent: QWidget, title: str, text: str, action: str = "Delete") -> bool:
    """Ask before something that cannot be undone; Cancel is the default (Esc, Enter)."""
    box = QMessageBox(parent)
    box.setObjectName("confirmDialog")
    box.setIcon(QMessageBox.Icon.Warning)
    box.setWindowTitle(title)
    box.setText(text)
    go = box.addButton(action, QMessageBox.ButtonRole.DestructiveRole)
    go.setObjectName("confirmButton")
    cancel = box.addButton(QMessageBox.StandardButton.Cancel)
    box.setDefaultButton(cancel)
    box.setEscapeButton(cancel)
    box.exec()
    clicked = box.clickedButton()
    box.deleteLater()
    return clicked is go
