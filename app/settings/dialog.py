"""Preferences: model, KV pool, defaults for new chats, theme, and the Hugging Face token.

The token field writes only to a secure OS keychain, or with none to memory for this run
(app/core/secrets.py); it is never kept in the settings database. Every value is checked
before the dialog closes (a missing model folder, a malformed repo id, bad sampling values),
with the problem shown in the dialog.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QRadioButton,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.core import secrets
from app.core.app_settings import AppSettings
from app.core.records import ChatSettings
from app.settings.disk_page import DiskCachePage
from app.settings.forms import ChatSettingsForm, CheckedDialog
from app.settings.providers_page import ProvidersPage
from app.settings.tools_page import ToolsPage
from engine import BLOCK_SIZES, EngineConfig, SamplingParams, blocks_for_budget


class SettingsDialog(CheckedDialog):
    def __init__(self, settings: AppSettings, parent: QWidget | None = None,
                 registry: Any = None, tools: Any = None,
                 new_chat_defaults: tuple[SamplingParams, str] | None = None,
                 model_info: Any = None, disk_stats: Any = None,
                 clear_disk: Any = None) -> None:
        super().__init__("Settings", "Settings", 520, parent)
        self._initial = settings
        self._model_info = model_info  # the loaded model's (sizes the KV precision hint)
        # what new chats really start with, and from where (SettingsFlow.new_chat_sampling):
        # shown while the user never set their own, so both dialogs tell one story
        self._follows_model = settings.default_sampling == SamplingParams()
        self._shown_defaults = (new_chat_defaults[0] if new_chat_defaults and self._follows_model
                                else settings.default_sampling)
        self._defaults_source = new_chat_defaults[1] if new_chat_defaults else ""
        self.token_changed = False
        tabs = QTabWidget()
        tabs.setAccessibleName("Settings sections")
        self.body.addWidget(tabs)
        tabs.addTab(self._model_tab(settings), "&Model")
        tabs.addTab(self._defaults_tab(settings), "&New Chats")
        tabs.addTab(self._appearance_tab(settings), "&Appearance")
        # the KV disk tier (§3.14): its budget, what it holds, Clear
        self.disk_page = DiskCachePage(settings.disk_budget_mib, disk_stats, clear_disk)
        tabs.addTab(self.disk_page, "Memor&y")
        self.tabs = tabs
        self.providers_page: ProvidersPage | None = None
        if registry is not None:  # applied at once (keys go straight to the keychain)
            self.providers_page = ProvidersPage(registry)
            tabs.addTab(self.providers_page, "&Providers")
        self.tools_page: ToolsPage | None = None
        if tools is not None:  # the MCP servers (app/core/mcp.py), applied at once too
            self.tools_page = ToolsPage(tools)
            tabs.addTab(self.tools_page, "&Tools")
        self._kind_changed()

    # ---- tabs ----------------------------------------------------------------------------

    def _model_tab(self, s: AppSettings) -> QWidget:
        page = QWidget()
        v = QVBoxLayout(page)
        box = QGroupBox("Model")
        b = QVBoxLayout(box)
        self.kind_group = QButtonGroup(self)
        self.kind_default = QRadioButton("&Default (embedded SmolLM2-135M-Instruct)")
        self.kind_folder = QRadioButton("&Local mlx-lm folder:")
        self.kind_hf = QRadioButton("&Hugging Face repo:")
        for i, r in enumerate((self.kind_default, self.kind_folder, self.kind_hf)):
            self.kind_group.addButton(r, i)
            r.toggled.connect(self._kind_changed)
        b.addWidget(self.kind_default)
        row = QHBoxLayout()
        row.addWidget(self.kind_folder)
        self.folder_edit = QLineEdit(s.model_folder)
        self.folder_edit.setAccessibleName("Model folder")
        self.folder_edit.setPlaceholderText("/path/to/mlx-model")
        row.addWidget(self.folder_edit, 1)
        self.browse = QPushButton("Choose…")
        self.browse.setAccessibleName("Choose model folder")
        self.browse.clicked.connect(self._choose_folder)
        row.addWidget(self.browse)
        b.addLayout(row)
        row = QHBoxLayout()
        row.addWidget(self.kind_hf)
        self.repo_edit = QLineEdit(s.model_repo)
        self.repo_edit.setAccessibleName("Hugging Face repo id")
        self.repo_edit.setPlaceholderText("mlx-community/Qwen3-0.6B-4bit")
        row.addWidget(self.repo_edit, 1)
        b.addLayout(row)
        {"folder": self.kind_folder, "hf": self.kind_hf}.get(
            s.model_kind, self.kind_default
        ).setChecked(True)
        v.addWidget(box)

        token_box = QGroupBox("Hugging Face token")
        t = QFormLayout(token_box)
        self.token_edit = QLineEdit(secrets.get_hf_token() or "")
        self.token_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.token_edit.setAccessibleName("Hugging Face token")
        self.token_edit.setPlaceholderText("hf_… (only for gated or private repos)")
        t.addRow("&Token:", self.token_edit)
        note = QLabel(secrets.storage_note())  # says so when there is no secure keychain
        note.setWordWrap(True)
        note.setObjectName("hint")
        note.setAccessibleName("Where the token is kept")
        self.token_note = note
        t.addRow(note)
        v.addWidget(token_box)

        pool = QGroupBox("KV cache pool")
        f = QFormLayout(pool)
        self.kv_spin = QDoubleSpinBox()
        self.kv_spin.setRange(1, 1 << 20)
        self.kv_spin.setDecimals(0)
        self.kv_spin.setSuffix(" MiB")
        self.kv_spin.setValue(s.kv_memory_mib)
        self.kv_spin.setAccessibleName("KV memory budget")
        f.addRow("&Memory budget:", self.kv_spin)
        self.block_combo = QComboBox()
        self.block_combo.setAccessibleName("Block size")
        for bs in BLOCK_SIZES:
            self.block_combo.addItem(f"{bs} tokens", bs)
        self.block_combo.setCurrentIndex(max(0, self.block_combo.findData(s.block_size)))
        f.addRow("&Block size:", self.block_combo)
        self.precision_combo = QComboBox()
        self.precision_combo.setAccessibleName("KV precision")
        for label, value in (("Automatic", "auto"), ("16-bit (the model's own)", "model"),
                             ("8-bit", "int8")):
            self.precision_combo.addItem(label, value)
        self.precision_combo.setCurrentIndex(
            max(0, self.precision_combo.findData(s.kv_precision)))
        f.addRow("KV &precision:", self.precision_combo)
        precision_hint = QLabel(
            "8-bit stores K and V in about half the bytes of 16-bit (a quarter of 32-bit), so "
            "the same budget holds about twice the tokens; Automatic uses it when the budget "
            "cannot hold every chat's full context.")
        precision_hint.setObjectName("hint")
        precision_hint.setWordWrap(True)
        precision_hint.setAccessibleName("What each KV precision buys")
        self.precision_hint = precision_hint
        f.addRow(precision_hint)
        self.kv_spin.valueChanged.connect(self._update_precision_hint)
        self.block_combo.currentIndexChanged.connect(self._update_precision_hint)
        self._update_precision_hint()
        self.speculative_check = QCheckBox("&Speculative decoding (faster edits and regenerations)")
        self.speculative_check.setAccessibleName("Speculative decoding")
        self.speculative_check.setToolTip(
            "Drafts tokens from the chat's own text, its sibling replies and the reply a "
            "regeneration replaces, and checks them in the same step; replies are "
            "unchanged, and drafting stops where it does not pay. On a GPU the engine keeps "
            "it off until it is measured there.")
        self.speculative_check.setChecked(bool(s.speculative))
        f.addRow(self.speculative_check)
        hint = QLabel("Changing the model or the pool restarts the engine; open chats stay.")
        hint.setObjectName("hint")
        hint.setWordWrap(True)
        f.addRow(hint)
        v.addWidget(pool)
        v.addStretch(1)
        return page

    def _defaults_tab(self, s: AppSettings) -> QWidget:
        page = QWidget()
        v = QVBoxLayout(page)
        defaults = ChatSettings(s.default_system_prompt, self._shown_defaults)
        self.defaults = ChatSettingsForm(
            defaults, "Default &system prompt for new chats:", "Default system prompt", 90,
            with_tools=False,
        )
        self.system_prompt = self.defaults.system_prompt
        self.sampling = self.defaults.sampling
        v.addWidget(self.defaults)
        if self._defaults_source:
            note = QLabel(f"Sampling from {self._defaults_source}; changing a value makes it "
                          "yours for every new chat.")
            note.setObjectName("hint")
            note.setWordWrap(True)
            note.setAccessibleName("Where the defaults come from")
            self.defaults_source_label = note
            v.addWidget(note)
        v.addStretch(1)
        return page

    def _appearance_tab(self, s: AppSettings) -> QWidget:
        page = QWidget()
        f = QFormLayout(page)
        self.theme_combo = QComboBox()
        self.theme_combo.setAccessibleName("Theme")
        for label, value in (("System", "system"), ("Light", "light"), ("Dark", "dark")):
            self.theme_combo.addItem(label, value)
        self.theme_combo.setCurrentIndex(max(0, self.theme_combo.findData(s.theme)))
        f.addRow("&Theme:", self.theme_combo)
        return page

    # ---- behaviour -----------------------------------------------------------------------

    def _update_precision_hint(self, *_args: object) -> None:
        """What 8-bit buys for the loaded model at this budget, by the engine's own arithmetic
        (``blocks_for_budget`` at each precision's bytes per block, shared by the chats the
        engine decodes at once); the general rule when no paged model is loaded."""
        info = self._model_info
        full = getattr(info, "full_bytes_per_block", 0) or getattr(info, "bytes_per_block", 0)
        if info is None or not getattr(info, "paged", False) or not full:
            return
        eight = getattr(info, "int8_bytes_per_block", 0)
        if not eight:
            return
        size = max(1, int(getattr(info, "block_size", 16)))
        slots = int(self.block_combo.currentData())
        budget = float(self.kv_spin.value())
        per_token_16, per_token_8 = full // size, eight // size
        chats = EngineConfig().max_batch
        t16 = blocks_for_budget(per_token_16, slots, budget) * slots
        t8 = blocks_for_budget(per_token_8, slots, budget) * slots
        self.precision_hint.setText(
            f"For {info.name} at this budget: {t16:,} tokens at the model's own precision, "
            f"{t8:,} at 8-bit — about {(t8 - t16) // chats:,} more tokens per chat with "
            f"{chats} chats at once. Automatic uses 8-bit when the budget cannot hold every "
            "chat's full context.")

    def _kind_changed(self, *_args: object) -> None:
        self.folder_edit.setEnabled(self.kind_folder.isChecked())
        self.browse.setEnabled(self.kind_folder.isChecked())
        self.repo_edit.setEnabled(self.kind_hf.isChecked())

    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(
            self, "Choose an mlx-lm model folder", self.folder_edit.text()
        )
        if folder:
            self.folder_edit.setText(folder)
            self.kind_folder.setChecked(True)

    def value(self) -> AppSettings:
        """The edited settings (raises ValueError when the engine refuses the sampling)."""
        kind = {1: "folder", 2: "hf"}.get(self.kind_group.checkedId(), "default")
        return AppSettings(
            model_kind=kind,
            model_folder=self.folder_edit.text().strip(),
            model_repo=self.repo_edit.text().strip(),
            kv_memory_mib=float(self.kv_spin.value()),
            block_size=int(self.block_combo.currentData()),
            kv_precision=str(self.precision_combo.currentData()),
            speculative=self.speculative_check.isChecked(),
            theme=str(self.theme_combo.currentData()),
            default_system_prompt=self.system_prompt.toPlainText(),
            default_sampling=self._chosen_sampling(),
            disk_budget_mib=self.disk_page.value(),
            kv_cache_dir=self._initial.kv_cache_dir,
        )

    def _chosen_sampling(self) -> SamplingParams:
        """The form's values; left as the model's own, they stay "follow the model" (so a
        model loaded later brings its own defaults)."""
        chosen = self.sampling.value()
        if self._follows_model and chosen == self._shown_defaults:
            return SamplingParams()
        return chosen

    def problem(self) -> str | None:
        problem = self.sampling.error() or self.value().validate()
        if problem:
            return problem
        token = self.token_edit.text().strip()
        if token != (secrets.get_hf_token() or ""):
            try:
                secrets.set_hf_token(token)
            except secrets.SecretStoreError as exc:
                return str(exc)
            self.token_changed = True
        return None
