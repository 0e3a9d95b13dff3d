"""Settings ▸ Providers: add, edit and remove OpenAI-compatible endpoints, fetch their model
lists and test the connection.

Changes apply at once through the ProviderRegistry (names and addresses in the database, the
key in the OS keychain only); the key field never shows a stored key, it only says whether
one is kept. Fetching and testing are awaited on the qasync loop, so the dialog stays live
and a slow or dead server only shows "Testing…" until its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.core.providers import KEEP, ProviderRegistry
from app.core.providers.client import check_connection, describe_error, list_models
from app.core.secrets import SecretStoreError, secure_backend
from app.ui import icons

ID_ROLE = Qt.ItemDataRole.UserRole


class ProvidersPage(QWidget):
    def __init__(self, registry: ProviderRegistry, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.registry = registry
        self._task: asyncio.Future | None = None
        v = QVBoxLayout(self)
        self.list = QListWidget()
        self.list.setAccessibleName("Providers")
        self.list.currentItemChanged.connect(self._selected)
        v.addWidget(self.list, 1)
        form = QFormLayout()
        self.name_edit = QLineEdit()
        self.name_edit.setAccessibleName("Provider name")
        self.name_edit.setPlaceholderText("Team vLLM")
        form.addRow("&Name:", self.name_edit)
        self.url_edit = QLineEdit()
        self.url_edit.setAccessibleName("Provider base URL")
        self.url_edit.setPlaceholderText("http://gpu-box:8000/v1")
        form.addRow("Base &URL:", self.url_edit)
        self.key_edit = QLineEdit()
        self.key_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.key_edit.setAccessibleName("Provider API key")
        form.addRow("API &key:", self.key_edit)
        where = secure_backend()
        self.key_note = QLabel(
            f"Optional. Kept only in the system keychain ({where})." if where else
            "Optional. No system keychain: a key is kept in memory for this run only.")
        self.key_note.setObjectName("hint")
        self.key_note.setWordWrap(True)
        form.addRow(self.key_note)
        v.addLayout(form)
        row = QHBoxLayout()
        self.add_button = self._button("&Add", "Add provider", self.add)
        self.save_button = self._button("Sa&ve", "Save provider changes", self.save)
        self.remove_button = self._button("&Remove", "Remove provider", self.remove)
        self.refresh_button = self._button("Re&fresh Models", "Refresh the model list",
                                           self.refresh_models)
        self.test_button = self._button("&Test Connection", "Test the connection",
                                        self.test_connection)
        for b in (self.add_button, self.save_button, self.remove_button, self.refresh_button,
                  self.test_button):
            row.addWidget(b)
        v.addLayout(row)
        self.models_label = QLabel()
        self.models_label.setWordWrap(True)
        self.models_label.setAccessibleName("Provider models")
        v.addWidget(self.models_label)
        self.result_label = QLabel()
        self.result_label.setWordWrap(True)
        self.result_label.setAccessibleName("Provider result")
        v.addWidget(self.result_label)
        self._reload()

    def _button(self, text: str, name: str, slot: Any) -> QPushButton:
        b = QPushButton(text)
        b.setAccessibleName(name)
        b.clicked.connect(slot)
        return b

    # ---- list ----------------------------------------------------------------------------

    def _reload(self, select: str | None = None) -> None:
        self.list.blockSignals(True)
        self.list.clear()
        for p in self.registry.providers():
            item = QListWidgetItem(f"{p.name} — {p.base_url}")
            item.setData(ID_ROLE, p.id)
            self.list.addItem(item)
            if p.id == select:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        self._selected()

    def current_id(self) -> str | None:
        item = self.list.currentItem()
        return item.data(ID_ROLE) if item is not None else None

    def _selected(self, *_args: object) -> None:
        p = self.registry.get(self.current_id() or "")
        for b in (self.save_button, self.remove_button, self.refresh_button, self.test_button):
            b.setEnabled(p is not None)
        self.key_edit.clear()
        if p is None:
            self.models_label.setText("Add a provider: any server with the OpenAI API"
                                      " (vLLM, another PagedChat, a hosted API).")
            self.key_edit.setPlaceholderText("optional")
            return
        self.name_edit.setText(p.name)
        self.url_edit.setText(p.base_url)
        has_key = bool(self.registry.key(p))
        self.key_edit.setPlaceholderText("a key is stored (type to replace)" if has_key
                                         else "no key stored")
        self._show_models(p.models)

    def _show_models(self, models: list[str]) -> None:
        self.models_label.setText(
            f"Models: {', '.join(models)}" if models else
            "No model list yet: press Refresh Models.")

    # ---- edits ---------------------------------------------------------------------------

    def add(self) -> None:
        try:
            p = self.registry.add(self.name_edit.text(), self.url_edit.text(),
                                  self.key_edit.text() or None)
        except (ValueError, SecretStoreError) as exc:
            self.result_label.setText(str(exc))
            return
        self.result_label.setText(f"Added {p.name}. Fetching its models…")
        self._reload(select=p.id)
        self.refresh_models()

    def save(self) -> None:
        pid = self.current_id()
        if pid is None:
            return
        key: Any = self.key_edit.text() if self.key_edit.text() else KEEP
        try:
            p = self.registry.update(pid, self.name_edit.text(), self.url_edit.text(), key)
        except (ValueError, SecretStoreError) as exc:
            self.result_label.setText(str(exc))
            return
        self.result_label.setText(f"Saved {p.name}.")
        self._reload(select=pid)

    def remove(self) -> None:
        pid = self.current_id()
        p = self.registry.get(pid or "")
        if p is None:
            return
        self.registry.remove(p.id)
        self.result_label.setText(f"Removed {p.name} (and its key). Its chats keep their"
                                  " messages; pick another model in their header.")
        self._reload()

    # ---- network -------------------------------------------------------------------------

    def refresh_models(self) -> None:
        p = self.registry.get(self.current_id() or "")
        if p is None:
            return
        self.result_label.setText(f"Fetching the models of {p.name}…")

        async def run() -> None:
            key = self.registry.key(p)
            try:
                models = await list_models(p, key)
            except Exception as exc:
                self._set_result(describe_error(exc, p, key=key))
                return
            self.registry.set_models(p.id, models)
            self._set_result(f"{p.name} lists {len(models)} model(s).")
            with contextlib.suppress(RuntimeError):  # the dialog closed meanwhile
                if self.current_id() == p.id:
                    self._show_models(models)

        self._start(run())

    def test_connection(self) -> None:
        p = self.registry.get(self.current_id() or "")
        if p is None:
            return
        self.result_label.setText(f"Testing {p.name}…")

        async def run() -> None:
            ok, text, models = await check_connection(p, self.registry.key(p))
            if ok:
                self.registry.set_models(p.id, models)
                with contextlib.suppress(RuntimeError):  # the dialog closed meanwhile
                    if self.current_id() == p.id:
                        self._show_models(models)
            mark = icons.drawable("✓ ", "") if ok else icons.drawable("✗ ", "")
            self._set_result(mark + text)

        self._start(run())

    def _set_result(self, text: str) -> None:
        with contextlib.suppress(RuntimeError):  # the dialog closed meanwhile
            self.result_label.setText(text)

    def _start(self, coro: Any) -> None:
        self._task = asyncio.ensure_future(coro)

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()
