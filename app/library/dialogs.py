"""File ▸ Export Chat…, Export All Chats…, Import Chats…: the file dialogs in front of
app/core/exchange.py (docs/ARCHITECTURE.md §6.5).

The choice of format is the dialog's file-type list ("HTML, every branch (*.html)"), so one
standard dialog asks everything; Qt's own (non-native) dialog is used so it looks and behaves
the same on every platform and tests can drive it. Errors are shown in a message box; an
import that fails imports nothing (the exchange module checks before it writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtWidgets import QFileDialog, QMessageBox, QWidget

from app.core import exchange
from app.core.exchange import ExchangeError
from app.core.records import Conversation


@dataclass(frozen=True)
class Choice:
    label: str
    fmt: str
    whole_tree: bool = False
    as_zip: bool = False

    @property
    def suffix(self) -> str:
        return ".zip" if self.as_zip else exchange.SUFFIX[self.fmt]

    @property
    def filter(self) -> str:
        return f"{self.label} (*{self.suffix})"


CHAT_CHOICES = (
    Choice("Markdown, the branch shown", "markdown"),
    Choice("Markdown, every branch", "markdown", whole_tree=True),
    Choice("HTML, the branch shown", "html"),
    Choice("HTML, every branch", "html", whole_tree=True),
    Choice("JSON, the whole chat (can be imported again)", "json", whole_tree=True),
)
ALL_CHOICES = (
    Choice("JSON files in a zip (can be imported again)", "json", True, as_zip=True),
    Choice("Markdown files in a zip", "markdown", True, as_zip=True),
    Choice("HTML files in a zip", "html", True, as_zip=True),
    Choice("JSON files in a new folder", "json", True),
    Choice("Markdown files in a new folder", "markdown", True),
    Choice("HTML files in a new folder", "html", True),
)
IMPORT_FILTER = "PagedChat exports (*.json *.zip)"
FOLDER_KEY = "library_folder"  # the folder the last export or import used


def _file_dialog(
    parent: QWidget, store: Any, title: str, filters: list[str], save: bool
) -> QFileDialog:
    folder = store.get_value(FOLDER_KEY)
    if not isinstance(folder, str) or not Path(folder).is_dir():
        folder = str(Path.home())
    dialog = QFileDialog(parent, title, folder)
    dialog.setObjectName("libraryFileDialog")
    dialog.setOption(QFileDialog.Option.DontUseNativeDialog, True)
    dialog.setNameFilters(filters)
    if save:
        dialog.setAcceptMode(QFileDialog.AcceptMode.AcceptSave)
        dialog.setFileMode(QFileDialog.FileMode.AnyFile)
    else:
        dialog.setAcceptMode(QFileDialog.AcceptMode.AcceptOpen)
        dialog.setFileMode(QFileDialog.FileMode.ExistingFile)
    return dialog


def _chosen_path(dialog: QFileDialog, store: Any) -> Path | None:
    """The file the user chose (None when cancelled); its folder is remembered."""
    if not dialog.exec() or not dialog.selectedFiles():
        return None
    path = Path(dialog.selectedFiles()[0])
    store.set_value(FOLDER_KEY, str(path.parent))
    return path


def _ask(
    dialog: QFileDialog, store: Any, choices: tuple[Choice, ...]
) -> tuple[Path, Choice] | None:
    path = _chosen_path(dialog, store)
    if path is None:
        return None
    chosen = dialog.selectedNameFilter()
    choice = next((c for c in choices if c.filter == chosen), choices[0])
    is_folder = choices is ALL_CHOICES and not choice.as_zip
    if not is_folder and path.suffix.lower() != choice.suffix:
        path = path.with_name(path.name + choice.suffix)
    return path, choice


def _fail(parent: QWidget, title: str, exc: Exception) -> None:
    QMessageBox.warning(parent, title, str(exc))


def export_chat(parent: QWidget, store: Any, conversation_id: str, title: str) -> Path | None:
    """Ask where and how, then write one chat; the path written, or None."""
    dialog = _file_dialog(parent, store, "Export Chat", [c.filter for c in CHAT_CHOICES], save=True)
    dialog.selectFile(exchange.file_name(exchange.load_chat(store, conversation_id), "markdown",
                                         set()).removesuffix(".md"))
    asked = _ask(dialog, store, CHAT_CHOICES)
    if asked is None:
        return None
    path, choice = asked
    try:
        return exchange.export_chat(store, conversation_id, path, choice.fmt, choice.whole_tree)
    except (ExchangeError, OSError) as exc:
        _fail(parent, "Export Chat", exc)
        return None


def export_all(parent: QWidget, store: Any) -> tuple[Path, int] | None:
    """Ask where and how, then write every chat, one file each (a zip or a new folder)."""
    filters = [c.filter for c in ALL_CHOICES]
    dialog = _file_dialog(parent, store, "Export All Chats", filters, save=True)
    dialog.selectFile("PagedChat chats")
    asked = _ask(dialog, store, ALL_CHOICES)
    if asked is None:
        return None
    path, choice = asked
    if not choice.as_zip and path.exists() and any(path.iterdir()):
        _fail(parent, "Export All Chats",
              ExchangeError(f"{path} is not empty: choose a new folder name."))
        return None
    try:
        return exchange.export_all(store, path, choice.fmt, choice.as_zip, choice.whole_tree)
    except (ExchangeError, OSError) as exc:
        _fail(parent, "Export All Chats", exc)
        return None


def import_chats(parent: QWidget, store: Any) -> list[Conversation]:
    """Ask for a JSON export (or a zip of them) and import it whole, or explain why not."""
    filters = [IMPORT_FILTER, "All files (*)"]
    dialog = _file_dialog(parent, store, "Import Chats", filters, save=False)
    path = _chosen_path(dialog, store)
    if path is None:
        return []
    try:
        return exchange.import_file(store, path)
    except ExchangeError as exc:
        _fail(parent, "Import Chats", ExchangeError(f"Nothing was imported.\n\n{exc}"))
        return []
