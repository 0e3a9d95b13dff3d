"""Application-wide settings (model, KV budget, defaults, theme), stored in the app database.

Kept as one small dataclass so the settings dialog, the command line and the engine restart
logic agree on what "the model" is. Secrets are not here: see app/core/secrets.py.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.core.records import ChatSettings
from app.core.serial import from_json, to_json
from engine import (
    BLOCK_SIZES,
    KV_PRECISIONS,
    EngineConfig,
    SamplingParams,
    looks_like_repo_id,
)
from engine.config import DEFAULT_DISK_BUDGET_MIB

#: Fields that describe this run, not the user's choice: never saved.
RUNTIME_FIELDS = ("kv_cache_dir",)


def default_kv_cache_dir() -> Path:
    """Where the KV disk tier lives (docs/ARCHITECTURE.md §3.14): the platform's cache folder
    (``~/Library/Caches/PagedChat/kv`` on a Mac, ``$XDG_CACHE_HOME/pagedchat/kv`` elsewhere),
    or ``PAGEDCHAT_KV_CACHE``. A cache, not data: deleting it only costs recomputation."""
    override = os.environ.get("PAGEDCHAT_KV_CACHE")
    if override:
        return Path(override).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "PagedChat" / "kv"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedchat" / "kv"

SETTINGS_KEY = "app_settings"
MODEL_KINDS = ("default", "folder", "hf")
THEMES = ("system", "light", "dark")


@dataclass
class AppSettings:
    model_kind: str = "default"  # "default" | "folder" | "hf"
    model_folder: str = ""
    model_repo: str = ""
    kv_memory_mib: float = 256.0
    block_size: int = 16
    #: KV precision (EngineConfig.kv_precision): "auto", "model" (16-bit on a Mac) or "int8".
    #: The model's own by default: 8-bit replies agree with it in 35% of greedy replies
    #: (bench/results/kv8.md), so 8-bit is the user's choice until that improves.
    kv_precision: str = "model"
    #: Speculative decoding (EngineConfig.speculative): drafts from the chat's own text and
    #: its sibling replies, verified in the same step; replies are unchanged. On lets the
    #: engine decide by backend (it drafts where steps run synchronously, §3.13); off never.
    speculative: bool = True
    theme: str = "system"  # "system" | "light" | "dark"
    default_system_prompt: str = ""
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    #: The KV disk tier's budget (0 turns it off): chats that sleep on disk (§3.14).
    disk_budget_mib: float = float(DEFAULT_DISK_BUDGET_MIB)
    #: The disk tier's folder for this run (set by the launcher, ``default_kv_cache_dir``;
    #: empty: no disk tier, as in tests that build settings themselves). Never saved.
    kv_cache_dir: str = ""

    # ---- the model ----------------------------------------------------------------------

    def model_spec(self) -> str:
        """What EngineConfig.model takes: "default", a folder path or a repo id."""
        if self.model_kind == "folder":
            return str(Path(self.model_folder).expanduser())
        if self.model_kind == "hf":
            return self.model_repo.strip()
        return "default"

    def set_model_spec(self, spec: str) -> None:
        """Interpret a --model value: "default", an existing/explicit path, else a repo id."""
        spec = spec.strip()
        if not spec or spec == "default":
            self.model_kind = "default"
        elif (
            os.path.exists(os.path.expanduser(spec))
            or spec.startswith(("/", ".", "~"))
            or not looks_like_repo_id(spec)
        ):
            self.model_kind, self.model_folder = "folder", spec
        else:
            self.model_kind, self.model_repo = "hf", spec

    def model_label(self) -> str:
        """A short name for the toolbar before the engine reports the real one."""
        if self.model_kind == "folder":
            return Path(self.model_folder).name or self.model_folder
        if self.model_kind == "hf":
            return self.model_repo
        return "SmolLM2-135M-Instruct"

    def validate(self) -> str | None:
        """A clear message for the first invalid value, or None when all is well."""
        if self.model_kind not in MODEL_KINDS:
            return f"Unknown model kind {self.model_kind!r}."
        if self.model_kind == "folder":
            folder = Path(self.model_folder).expanduser()
            if not self.model_folder.strip():
                return "Choose the folder of an mlx-lm model."
            if not folder.is_dir():
                return f"The model folder {folder} does not exist."
            if not (folder / "config.json").is_file():
                return f"{folder} is not an mlx-lm model folder (it has no config.json)."
        if self.model_kind == "hf" and not looks_like_repo_id(self.model_repo.strip()):
            return (
                "A Hugging Face repo id looks like owner/name, e.g. mlx-community/Qwen3-0.6B-4bit."
            )
        if self.theme not in THEMES:
            return f"Unknown theme {self.theme!r}."
        if not 1 <= self.kv_memory_mib <= 1 << 20:
            return "The KV memory budget must be between 1 MiB and 1 TiB."
        if not 0 <= self.disk_budget_mib <= 1 << 24:
            return "The disk cache budget must be between 0 (off) and 16 TiB."
        try:  # the rest is the engine's to judge, by its own rules
            self.engine_config()
        except ValueError as exc:
            return f"The engine refuses these settings: {exc}."
        return None

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """The EngineConfig these settings describe (raises ValueError for bad values)."""
        disk = self.kv_cache_dir if self.kv_cache_dir and self.disk_budget_mib > 0 else None
        overrides.setdefault("disk_cache_dir", disk)
        overrides.setdefault("disk_budget_mib", float(self.disk_budget_mib))
        return EngineConfig(
            model=self.model_spec(),
            kv_memory_mib=float(self.kv_memory_mib),
            block_size=int(self.block_size),
            kv_precision=self.kv_precision,
            speculative=None if self.speculative else False,
            **overrides,
        )

    def default_chat(self) -> ChatSettings:
        """The settings a new chat starts with."""
        return ChatSettings(self.default_system_prompt, self.default_sampling)

    def engine_key(self) -> tuple[str, float, int, str, float, str, bool]:
        """What needs an engine restart when it changes."""
        return (self.model_spec(), float(self.kv_memory_mib), int(self.block_size),
                self.kv_precision, float(self.disk_budget_mib), self.kv_cache_dir,
                bool(self.speculative))

    # ---- (de)serialisation ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = to_json(self)
        for name in RUNTIME_FIELDS:
            data.pop(name, None)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> AppSettings:
        out = from_json(cls, data)
        if out.model_kind not in MODEL_KINDS:
            out.model_kind = "default"
        if out.theme not in THEMES:
            out.theme = "system"
        if out.kv_precision not in KV_PRECISIONS:
            out.kv_precision = "model"
        if out.block_size not in BLOCK_SIZES:
            out.block_size = AppSettings.block_size
        if not isinstance(out.disk_budget_mib, int | float) or out.disk_budget_mib < 0:
            out.disk_budget_mib = AppSettings.disk_budget_mib
        out.kv_cache_dir = ""
        return out

    @classmethod
    def load(cls, store: Any) -> AppSettings:
        return cls.from_dict(store.get_value(SETTINGS_KEY))

    def save(self, store: Any) -> None:
        store.set_value(SETTINGS_KEY, self.to_dict())
