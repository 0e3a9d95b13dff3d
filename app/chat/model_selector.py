"""The pane header's model picker: the local engine's model or any provider's model.

Its entries come from the provider registry (the model lists last fetched in Settings ▸
Providers); a chat whose model is no longer listed (the provider was removed, or its list not
fetched yet) keeps an entry for it, so opening the chat never silently changes its model.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QSizePolicy, QWidget

from app.core.providers import LOCAL, model_ref


class ModelSelector(QComboBox):
    modelPicked = Signal(str)  # a model reference ("" = local), picked by the user

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("modelSelector")
        self.setAccessibleName("Model for this chat")
        self.setToolTip("The model this chat talks to: the local engine's or a provider's"
                        " (Settings ▸ Providers)")
        # a narrow pane must stay narrow (four panes and the monitor fit in 1280 px): size
        # for a few characters, elide the rest
        self.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.setMinimumContentsLength(3)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.setMinimumWidth(60)
        self.setMaximumWidth(240)
        self._filling = False
        self.activated.connect(self._activated)

    def fill(self, registry: Any, local_name: str, current: str) -> None:
        """List the local model and every provider's models; select `current`."""
        self._filling = True
        try:
            self.clear()
            self.addItem(f"Local · {local_name}", LOCAL)
            if registry is not None:
                for p in registry.providers():
                    for m in p.models:
                        self.addItem(f"{m} @ {p.name}", model_ref(p.id, m))
            i = self.findData(current)
            if i < 0:
                label = registry.label(current) if registry is not None else current
                self.addItem(label, current)
                i = self.count() - 1
            self.setCurrentIndex(i)
        finally:
            self._filling = False

    def current_ref(self) -> str:
        return self.currentData() or LOCAL

    def select_ref(self, ref: str) -> bool:
        """Pick `ref` as the user would (tests and keyboard users); False if not listed."""
        i = self.findData(ref)
        if i < 0:
            return False
        self.setCurrentIndex(i)
        self._activated(i)
        return True

    def _activated(self, index: int) -> None:
        if not self._filling:
            self.modelPicked.emit(self.itemData(index) or LOCAL)
