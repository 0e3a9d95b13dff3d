"""Settings ▸ Tools: the MCP servers whose tools chats may use (app/core/mcp.py).

A server is a command with its arguments (stdio) or a streamable-HTTP URL with an optional
key, which goes to the OS keychain only; the key field never shows a stored key. Changes
apply at once. "Test" lists the server's tools on the MCP client's own loop, so the dialog
stays live and a server that hangs only shows "Listing…" until its timeout. Each server has
an enabled switch (the check box in the list): a disabled server's tools are offered to no
chat. Which chats use tools is a chat setting (Chat Settings, or a folder's).
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QDoubleSpinBox,
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

from app.core.mcp import McpError, McpHub, McpServer
from app.core.secrets import SecretStoreError, secure_backend

ID_ROLE = Qt.ItemDataRole.UserRole


class ToolsPage(QWidget):
    def __init__(self, hub: McpHub, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.hub = hub
        self.servers = hub.servers
        self._task: asyncio.Future | None = None
        v = QVBoxLayout(self)
        intro = QLabel("MCP servers whose tools chats may use. Turn tools on for a chat in its"
                       " Chat Settings (or for a folder's new chats). Every call asks first.")
        intro.setWordWrap(True)
        intro.setObjectName("hint")
        v.addWidget(intro)
        self.list = QListWidget()
        self.list.setAccessibleName("MCP servers")
        self.list.currentItemChanged.connect(self._selected)
        self.list.itemChanged.connect(self._enabled_toggled)
        v.addWidget(self.list, 1)
        form = QFormLayout()
        self.name_edit = QLineEdit()
        self.name_edit.setAccessibleName("Server name")
        self.name_edit.setPlaceholderText("Files")
        form.addRow("&Name:", self.name_edit)
        self.command_edit = QLineEdit()
        self.command_edit.setAccessibleName("Server command")
        self.command_edit.setPlaceholderText("npx (stdio: a program to start)")
        form.addRow("&Command:", self.command_edit)
        self.args_edit = QLineEdit()
        self.args_edit.setAccessibleName("Server arguments")
        self.args_edit.setPlaceholderText("-y @modelcontextprotocol/server-filesystem ~/Notes")
        form.addRow("Ar&guments:", self.args_edit)
        self.url_edit = QLineEdit()
        self.url_edit.setAccessibleName("Server URL")
        self.url_edit.setPlaceholderText("or a streamable-HTTP URL: https://host/mcp")
        form.addRow("&URL:", self.url_edit)
        self.key_edit = QLineEdit()
        self.key_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.key_edit.setAccessibleName("Server key")
        where = secure_backend()
        self.key_edit.setToolTip(
            f"Optional bearer key for a URL. Kept only in the system keychain ({where})."
            if where else "Optional. No system keychain: a key is kept in memory for this run.")
        form.addRow("&Key:", self.key_edit)
        self.timeout_spin = QDoubleSpinBox()
        self.timeout_spin.setAccessibleName("Tool timeout in seconds")
        self.timeout_spin.setRange(0.5, 600.0)
        self.timeout_spin.setDecimals(1)
        self.timeout_spin.setSuffix(" s")
        self.timeout_spin.setValue(hub.timeout_s)
        self.timeout_spin.setToolTip("A server that takes longer to list its tools or answer a"
                                     " call counts as hung: the chat gets the error and goes on.")
        self.timeout_spin.valueChanged.connect(hub.set_timeout)
        form.addRow("&Timeout:", self.timeout_spin)
        v.addLayout(form)
        row = QHBoxLayout()
        self.add_button = self._button("&Add", "Add server", self.add)
        self.save_button = self._button("Sa&ve", "Save server changes", self.save)
        self.remove_button = self._button("&Remove", "Remove server", self.remove)
        self.test_button = self._button("T&est", "List the server's tools", self.test)
        for b in (self.add_button, self.save_button, self.remove_button, self.test_button):
            row.addWidget(b)
        v.addLayout(row)
        self.tools_label = QLabel()
        self.tools_label.setWordWrap(True)
        self.tools_label.setAccessibleName("Server tools")
        self.tools_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        v.addWidget(self.tools_label)
        self.result_label = QLabel()
        self.result_label.setWordWrap(True)
        self.result_label.setAccessibleName("Server result")
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
        for s in self.servers.servers():
            item = QListWidgetItem(f"{s.name} — {s.describe()}")
            item.setData(ID_ROLE, s.id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
            item.setCheckState(Qt.CheckState.Checked if s.enabled else Qt.CheckState.Unchecked)
            item.setToolTip("Checked: its tools are offered to chats with tools on")
            self.list.addItem(item)
            if s.id == select:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        self._selected()

    def current_id(self) -> str | None:
        item = self.list.currentItem()
        return item.data(ID_ROLE) if item is not None else None

    def _enabled_toggled(self, item: QListWidgetItem) -> None:
        self.servers.set_enabled(item.data(ID_ROLE),
                                 item.checkState() == Qt.CheckState.Checked)

    def _selected(self, *_args: object) -> None:
        s = self.servers.get(self.current_id() or "")
        for b in (self.save_button, self.remove_button, self.test_button):
            b.setEnabled(s is not None)
        self.key_edit.clear()
        if s is None:
            self.tools_label.setText("Add a server: a command that speaks MCP over stdio, or"
                                     " the URL of a streamable-HTTP MCP server.")
            self.key_edit.setPlaceholderText("optional, for a URL")
            return
        self.name_edit.setText(s.name)
        self.command_edit.setText(s.command)
        self.args_edit.setText(shlex.join(s.args))
        self.url_edit.setText(s.url)
        self.key_edit.setPlaceholderText("a key is stored (type to replace)"
                                         if self.servers.key(s) else "no key stored")
        self._show_tools(s)

    def _show_tools(self, server: McpServer) -> None:
        tools = self.servers.tools.get(server.id)
        error = self.servers.errors.get(server.id)
        if error:
            self.tools_label.setText(f"✗ {error}")
        elif tools is None:
            self.tools_label.setText("Tools not listed yet: press Test.")
        elif not tools:
            self.tools_label.setText("This server lists no tools.")
        else:
            lines = [f"• {t.name}" + (f": {t.description}" if t.description else "")
                     + (" (always allowed)" if t.name in server.always_allowed else "")
                     for t in tools]
            self.tools_label.setText(f"{len(tools)} tool(s):\n" + "\n".join(lines))

    # ---- edits ---------------------------------------------------------------------------

    def _fields(self) -> dict[str, Any]:
        try:
            args = shlex.split(self.args_edit.text())
        except ValueError as exc:
            raise ValueError(f"The arguments do not parse: {exc}") from exc
        return {"name": self.name_edit.text(), "command": self.command_edit.text(),
                "args": args, "url": self.url_edit.text()}

    def add(self) -> None:
        try:
            s = self.servers.add(**self._fields(), key=self.key_edit.text() or None)
        except (ValueError, SecretStoreError) as exc:
            self.result_label.setText(str(exc))
            return
        self.result_label.setText(f"Added {s.name}. Listing its tools…")
        self._reload(select=s.id)
        self.test()

    def save(self) -> None:
        sid = self.current_id()
        if sid is None:
            return
        try:
            s = self.servers.update(sid, **self._fields(), key=self.key_edit.text() or None,
                                    enabled=self.servers.get(sid).enabled)
        except (ValueError, SecretStoreError) as exc:
            self.result_label.setText(str(exc))
            return
        self.result_label.setText(f"Saved {s.name}.")
        self._reload(select=sid)

    def remove(self) -> None:
        s = self.servers.get(self.current_id() or "")
        if s is None:
            return
        self.servers.remove(s.id)
        self.result_label.setText(f"Removed {s.name} (and its key).")
        self._reload()

    def test(self) -> None:
        s = self.servers.get(self.current_id() or "")
        if s is None:
            return
        self.result_label.setText(f"Listing the tools of {s.name}…")

        async def run() -> None:
            try:
                tools = await self.hub.refresh(s)
            except McpError as exc:
                self._set_result(f"✗ {exc}")
            else:
                self._set_result(f"✓ {s.name} lists {len(tools)} tool(s).")
            with contextlib.suppress(RuntimeError):  # the dialog closed meanwhile
                if self.current_id() == s.id:
                    self._show_tools(s)

        self._task = asyncio.ensure_future(run())

    def _set_result(self, text: str) -> None:
        with contextlib.suppress(RuntimeError):  # the dialog closed meanwhile
            self.result_label.setText(text)

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()
