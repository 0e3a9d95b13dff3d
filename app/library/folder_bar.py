"""Folders in the sidebar: a short list above the chats ("All Chats", then each folder) that
filters the chat list and takes chats dropped on it (docs/ARCHITECTURE.md §6.5).

Chats are dragged from the chat list (their ids travel as `CHAT_IDS_MIME`); dropped on a
folder they move into it, dropped on "All Chats" they move to the top level. The context
menu creates, renames, deletes a folder (its chats move to the top level, never deleted)
and sets the system prompt and sampling its new chats start with.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import (
    QAbstractListModel,
    QByteArray,
    QMimeData,
    QModelIndex,
    QPersistentModelIndex,
    Qt,
    Signal,
)
from PySide6.QtGui import QContextMenuEvent
from PySide6.QtWidgets import QAbstractItemView, QFrame, QListView, QMenu, QWidget

from app.core.records import Folder
from app.ui.elided_label import ElidedLabel

CHAT_IDS_MIME = "application/x-pagedchat-chat-ids"
ALL = "__all__"  # the "All Chats" row: no filter; a drop there moves chats to the top level
FolderIdRole = Qt.ItemDataRole.UserRole + 1


def encode_chat_ids(ids: list[str]) -> QMimeData:
    mime = QMimeData()
    mime.setData(CHAT_IDS_MIME, QByteArray("\n".join(ids).encode("utf-8")))
    return mime


def decode_chat_ids(mime: QMimeData) -> list[str]:
    if not mime.hasFormat(CHAT_IDS_MIME):
        return []
    raw = bytes(mime.data(CHAT_IDS_MIME).data()).decode("utf-8", "replace")
    return [i for i in raw.split("\n") if i]


class FolderListModel(QAbstractListModel):
    chatsDropped = Signal(list, object)  # chat ids, folder id (None: the top level)
    renameRequested = Signal(str, str)  # folder id, new name

    def __init__(self, store: Any, parent: Any = None) -> None:
        super().__init__(parent)
        self.store = store
        self.folders: list[Folder] = []
        self.counts: dict[str | None, int] = {}
        self.reload()

    def reload(self) -> None:
        self.beginResetModel()
        self.folders = self.store.list_folders()
        self.counts = {}
        for c in self.store.list_conversations():
            self.counts[c.folder_id] = self.counts.get(c.folder_id, 0) + 1
        self.endResetModel()

    def folder_id(self, row: int) -> str:
        return ALL if row == 0 else self.folders[row - 1].id

    def row_of(self, folder_id: str) -> int:
        if folder_id == ALL:
            return 0
        return next((i + 1 for i, f in enumerate(self.folders) if f.id == folder_id), -1)

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else 1 + len(self.folders)

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = 0) -> Any:
        if not index.isValid():
            return None
        row = index.row()
        folder = self.folders[row - 1] if row else None
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.AccessibleTextRole):
            if folder is None:
                return "All Chats"
            n = self.counts.get(folder.id, 0)
            return f"{folder.name}  ({n})" if role == Qt.ItemDataRole.DisplayRole else (
                f"Folder {folder.name}, {n} chats"
            )
        if role == Qt.ItemDataRole.EditRole:
            return folder.name if folder else None
        if role == Qt.ItemDataRole.ToolTipRole and folder is not None:
            extra = ", with its own settings for new chats" if folder.settings else ""
            return f"{folder.name}{extra}. Drop chats here to move them in."
        if role == FolderIdRole:
            return self.folder_id(row)
        return None

    def setData(
        self, index: QModelIndex | QPersistentModelIndex, value: Any, role: int = 0
    ) -> bool:
        if role != Qt.ItemDataRole.EditRole or not index.isValid() or index.row() == 0:
            return False
        name = str(value).strip()
        if not name:
            return False
        folder = self.folders[index.row() - 1]
        folder.name = name
        self.renameRequested.emit(folder.id, name)
        self.dataChanged.emit(index, index)
        return True

    def flags(self, index: QModelIndex | QPersistentModelIndex) -> Qt.ItemFlag:
        base = super().flags(index)
        if not index.isValid():
            return base
        base |= Qt.ItemFlag.ItemIsDropEnabled
        return base | Qt.ItemFlag.ItemIsEditable if index.row() > 0 else base

    def mimeTypes(self) -> list[str]:
        return [CHAT_IDS_MIME]

    def supportedDropActions(self) -> Qt.DropAction:
        return Qt.DropAction.MoveAction | Qt.DropAction.CopyAction

    def canDropMimeData(self, data: QMimeData, action: Qt.DropAction, row: int, column: int,
                        parent: QModelIndex | QPersistentModelIndex) -> bool:
        return parent.isValid() and bool(decode_chat_ids(data))

    def dropMimeData(self, data: QMimeData, action: Qt.DropAction, row: int, column: int,
                     parent: QModelIndex | QPersistentModelIndex) -> bool:
        ids = decode_chat_ids(data)
        if not parent.isValid() or not ids:
            return False  # between rows, or not chats: nothing to do
        target = self.folder_id(parent.row())
        self.chatsDropped.emit(ids, None if target == ALL else target)
        return True


class FolderView(QListView):
    """The folder list; the sidebar acts on its requests (it owns the store and dialogs)."""

    folderChosen = Signal(str)  # folder id or ALL
    newFolderRequested = Signal()
    newChatRequested = Signal(str)  # in this folder
    settingsRequested = Signal(str)
    deleteRequested = Signal(str)

    def __init__(self, model: FolderListModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("folderList")
        self.setAccessibleName("Folders")
        self.setModel(model)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setAcceptDrops(True)
        self.setDropIndicatorShown(True)
        self.setDragDropMode(QAbstractItemView.DragDropMode.DropOnly)
        self.setDefaultDropAction(Qt.DropAction.MoveAction)
        self.setEditTriggers(QAbstractItemView.EditTrigger.EditKeyPressed)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setCurrentIndex(model.index(0))
        self.clicked.connect(self._chosen)
        self.activated.connect(self._chosen)

    def fit(self) -> None:
        """As tall as its rows (at most six; it scrolls beyond)."""
        rows = min(6, self.model().rowCount())
        self.setFixedHeight(rows * max(self.sizeHintForRow(0), 20) + 4)

    def current_folder(self) -> str:
        index = self.currentIndex()
        return index.data(FolderIdRole) if index.isValid() else ALL

    def choose(self, folder_id: str) -> None:
        row = self.model().row_of(folder_id)  # type: ignore[attr-defined]
        self.setCurrentIndex(self.model().index(max(row, 0), 0))
        self.folderChosen.emit(self.current_folder())

    def _chosen(self, index: Any) -> None:
        if index.isValid():
            self.folderChosen.emit(index.data(FolderIdRole))

    def contextMenuEvent(self, event: QContextMenuEvent) -> None:
        index = self.indexAt(event.pos())
        fid = index.data(FolderIdRole) if index.isValid() else ALL
        menu = QMenu(self)
        menu.setAccessibleName("Folder actions")
        menu.addAction("New Folder…", self.newFolderRequested.emit)
        if fid != ALL:
            menu.addAction("New Chat in Folder", lambda: self.newChatRequested.emit(fid))
            menu.addSeparator()
            menu.addAction("Rename…", lambda: self.edit(index))
            menu.addAction("Settings for New Chats…", lambda: self.settingsRequested.emit(fid))
            menu.addAction("Delete Folder…", lambda: self.deleteRequested.emit(fid))
        menu.exec(event.globalPos())


NAME_DIALOG_WIDTH = 360  # px of name field: room for the title and a long folder name


class FolderPanel(QWidget):
    """The folder list under a small header with a New Folder button. Creating, renaming and
    moving chats are done here (store writes); deleting, new chats and folder settings are
    asked of the window (`view`'s signals), which owns the confirmation and the dialogs."""

    changed = Signal()  # folders or chats' folders changed: the lists reload

    def __init__(self, store: Any, parent: QWidget | None = None) -> None:
        from PySide6.QtWidgets import QHBoxLayout, QToolButton, QVBoxLayout

        super().__init__(parent)
        self.store = store
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        top = QHBoxLayout()
        heading = ElidedLabel("Folders")  # its big font must not set the sidebar's minimum
        heading.setObjectName("sidebarHeading")
        top.addWidget(heading, 1)
        self.new_button = QToolButton()
        self.new_button.setText("+")
        self.new_button.setAccessibleName("New folder")
        self.new_button.setToolTip("New folder")
        self.new_button.setAutoRaise(True)
        self.new_button.clicked.connect(self.new_folder)
        top.addWidget(self.new_button)
        layout.addLayout(top)
        self.model = FolderListModel(store, self)
        self.view = FolderView(self.model)
        layout.addWidget(self.view)
        self.view.newFolderRequested.connect(self.new_folder)
        self.model.renameRequested.connect(self._rename)
        self.model.chatsDropped.connect(self.move_chats)
        self.view.fit()

    def reload(self) -> None:
        current = self.view.current_folder()
        self.model.reload()
        self.view.fit()
        row = self.model.row_of(current)
        self.view.setCurrentIndex(self.model.index(max(row, 0)))
        if row < 0:  # the folder shown was deleted: show all chats
            self.view.folderChosen.emit(ALL)

    def new_folder(self) -> Folder | None:
        from PySide6.QtWidgets import QInputDialog, QLineEdit

        # QInputDialog.getText made a dialog narrower than its own title (the window manager
        # cut it) with the platform's stock icons on its buttons
        dialog = QInputDialog(self)
        dialog.setWindowTitle("New Folder")
        dialog.setLabelText("Name of the new folder:")
        dialog.setOkButtonText("Create")
        edit = dialog.findChild(QLineEdit)  # (the dialog's layout sets its own minimum)
        if edit is not None:
            edit.setMinimumWidth(NAME_DIALOG_WIDTH)
        dialog.setAccessibleName("New folder")
        if dialog.exec() != QInputDialog.DialogCode.Accepted:
            return None
        name = dialog.textValue().strip()
        if not name:
            return None
        folder = self.store.create_folder(name)
        self.model.reload()
        self.view.fit()
        self.changed.emit()
        return folder

    def _rename(self, folder_id: str, name: str) -> None:
        self.store.rename_folder(folder_id, name)
        self.changed.emit()

    def move_chats(self, ids: list[str], folder_id: str | None) -> None:
        self.store.move_to_folder(ids, folder_id)
        self.reload()
        self.changed.emit()
