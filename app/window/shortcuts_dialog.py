"""Help ▸ Keyboard Shortcuts: every command's keys, grouped by menu, read off the window's
live actions (app/window/actions.py's table, as built), so the list can never drift from the keys
that work. Keys that belong to one widget rather than a command (Enter in a message box)
come from the same module's `KEYS_IN_PLACE`."""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

# (group, command, keys as the platform writes them)
Row = tuple[str, str, str]


class ShortcutsDialog(QDialog):
    def __init__(self, rows: Sequence[Row], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Keyboard Shortcuts")
        self.setAccessibleName("Keyboard shortcuts")
        self.resize(520, 560)
        layout = QVBoxLayout(self)
        self.tree = QTreeWidget()
        self.tree.setObjectName("shortcutList")
        self.tree.setAccessibleName("Keyboard shortcuts by menu")
        self.tree.setColumnCount(2)
        self.tree.setHeaderLabels(["Command", "Keys"])
        self.tree.setRootIsDecorated(False)
        self.tree.setUniformRowHeights(True)
        groups: dict[str, QTreeWidgetItem] = {}
        for group, command, keys in rows:
            if group not in groups:
                head = QTreeWidgetItem([group, ""])
                font = head.font(0)
                font.setBold(True)
                head.setFont(0, font)
                head.setFlags(Qt.ItemFlag.ItemIsEnabled)
                self.tree.addTopLevelItem(head)
                groups[group] = head
            item = QTreeWidgetItem([command, keys])
            item.setData(0, Qt.ItemDataRole.AccessibleTextRole, f"{command}: {keys}")
            groups[group].addChild(item)
        self.tree.expandAll()
        self.tree.resizeColumnToContents(0)
        layout.addWidget(self.tree)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

    def rows(self) -> list[Row]:
        """What the list shows (tests compare it with the window's actions)."""
        out = []
        for i in range(self.tree.topLevelItemCount()):
            head = self.tree.topLevelItem(i)
            for j in range(head.childCount()):
                c = head.child(j)
                out.append((head.text(0), c.text(0), c.text(1)))
        return out
