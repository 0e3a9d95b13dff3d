"""The chat library's flows: folders (delete, their settings for new chats) and moving chats
in and out of PagedChat (export one, export all, import).

Each flow asks the user through a real dialog (app/library/dialogs.py, app/ui/confirm.py),
changes the store, and tells the window what to show. Kept out of the main window, which only
lays out the widgets these flows talk to.
"""

from __future__ import annotations

from typing import Any, Protocol

from PySide6.QtWidgets import QDialog

from app.chat.chat_settings_dialog import ChatSettingsDialog
from app.library import dialogs as library_dialogs
from app.ui.confirm import confirm_destructive


class LibraryWindow(Protocol):
    """What the flows need of the main window (a QMainWindow: the dialogs' parent)."""

    store: Any
    sidebar: Any  # app.library.sidebar.Sidebar
    manager: Any  # app.chat.session.SessionManager

    @property
    def focused_pane(self) -> Any: ...

    def open_chat(self, conversation_id: str, new_pane: bool = False) -> Any: ...

    def statusBar(self) -> Any: ...  # noqa: N802 (Qt's name)


class LibraryFlow:
    def __init__(self, window: LibraryWindow) -> None:
        self.window = window

    def delete_folder(self, folder_id: str) -> bool:
        w = self.window
        folder = w.store.get_folder(folder_id)
        if folder is None:
            return False
        n = sum(1 for c in w.store.list_conversations() if c.folder_id == folder_id)
        chats = f"Its {n} chat{'s' if n != 1 else ''} move{'s' if n == 1 else ''} to the top level."
        if not confirm_destructive(
            w, "Delete Folder", f"Delete the folder “{folder.name}”? {chats}" if n else
            f"Delete the empty folder “{folder.name}”?"
        ):
            return False
        w.store.delete_folder(folder_id)
        w.sidebar.reload()
        return True

    def edit_folder_settings(self, folder_id: str) -> None:
        """The system prompt and sampling new chats in the folder start with."""
        w = self.window
        folder = w.store.get_folder(folder_id)
        if folder is None:
            return
        dialog = ChatSettingsDialog(folder.name, folder.settings or w.manager.default_settings,
                                    w)
        dialog.setWindowTitle(f"Settings for New Chats — {folder.name}")
        if dialog.exec() == QDialog.DialogCode.Accepted:
            w.store.set_folder_settings(folder_id, dialog.value())
            w.sidebar.reload()

    def export_focused_chat(self) -> None:
        w = self.window
        pane = w.focused_pane
        if pane is None or pane.session is None or not pane.session.tree.by_id:
            w.statusBar().showMessage("Nothing to export: this chat is empty.", 5000)
            return
        pane.session.flush()  # a streaming reply: export what is on screen
        path = library_dialogs.export_chat(w, w.store, pane.session.id, pane.session.title)
        if path is not None:
            w.statusBar().showMessage(f"Exported “{pane.session.title}” to {path}.", 8000)

    def export_all_chats(self) -> None:
        w = self.window
        for session in w.manager.sessions.values():
            session.flush()
        done = library_dialogs.export_all(w, w.store)
        if done is not None:
            path, n = done
            w.statusBar().showMessage(f"Exported {n} chats to {path}.", 8000)

    def import_chats(self) -> None:
        w = self.window
        imported = library_dialogs.import_chats(w, w.store)
        if not imported:
            return
        w.sidebar.reload()
        w.open_chat(imported[0].id)
        n = len(imported)
        w.statusBar().showMessage(f"Imported {n} chat{'s' if n > 1 else ''}.", 8000)
