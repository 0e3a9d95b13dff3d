"""Application-wide settings (model, KV budget, defaults, theme), stored in the app database.

Kept as one small dataclass so the settings dialog, the command line and the engine restart
logic agree on what "the model" is. Secrets are not here: see app/core/secrets.py.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.core.records import SamplingSettings

SETTINGS_KEY = "app_settings"
MODEL_KINDS = ("default", "folder", "hf")
THEMES = ("system", "light", "dark")
BLOCK_SIZES = (8, 16, 32)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass
class AppSettings:
    model_kind: str = "default"  # "default" | "folder" | "hf"
    model_folder: str = ""
    model_repo: str = ""
    kv_memory_mib: float = 256.0
    block_size: int = 16
    theme: str = "system"  # "system" | "light" | "dark"
    default_system_prompt: str = ""
    default_sampling: SamplingSettings = field(default_factory=SamplingSettings)

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
            or not _REPO_ID.match(spec)
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
        if self.model_kind == "hf" and not _REPO_ID.match(self.model_repo.strip()):
            return (
                "A Hugging Face repo id looks like owner/name, e.g. mlx-community/Qwen3-0.6B-4bit."
            )
        if not 1 <= self.kv_memory_mib <= 1 << 20:
            return "The KV memory budget must be between 1 MiB and 1 TiB."
        if self.block_size not in BLOCK_SIZES:
            return f"The block size must be one of {', '.join(map(str, BLOCK_SIZES))}."
        if self.theme not in THEMES:
            return f"Unknown theme {self.theme!r}."
        return None

    def engine_config(self, **overrides: Any) -> Any:
        """The EngineConfig these settings describe (raises ValueError for bad values)."""
        from engine import EngineConfig

        return EngineConfig(
            model=self.model_spec(),
            kv_memory_mib=float(self.kv_memory_mib),
            block_size=int(self.block_size),
            **overrides,
        )

    def engine_key(self) -> tuple[str, float, int]:
        """What needs an engine restart when it changes."""
        return (self.model_spec(), float(self.kv_memory_mib), int(self.block_size))

    # ---- (de)serialisation ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_kind": self.model_kind,
            "model_folder": self.model_folder,
            "model_repo": self.model_repo,
            "kv_memory_mib": self.kv_memory_mib,
            "block_size": self.block_size,
            "theme": self.theme,
            "default_system_prompt": self.default_system_prompt,
            "default_sampling": self.default_sampling.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Any) -> AppSettings:
        out = cls()
        if not isinstance(data, dict):
            return out
        for key in ("model_kind", "model_folder", "model_repo", "theme", "default_system_prompt"):
            if isinstance(data.get(key), str):
                setattr(out, key, data[key])
        try:
            out.kv_memory_mib = float(data.get("kv_memory_mib", out.kv_memory_mib))
            out.block_size = int(data.get("block_size", out.block_size))
        except (TypeError, ValueError):
            pass
        out.default_sampling = SamplingSettings.from_dict(data.get("default_sampling"))
        if out.model_kind not in MODEL_KINDS:
            out.model_kind = "default"
        if out.theme not in THEMES:
            out.theme = "system"
        if out.block_size not in BLOCK_SIZES:
            out.block_size = 16
        return out

    @classmethod
    def load(cls, store: Any) -> AppSettings:
        return cls.from_dict(store.get_value(SETTINGS_KEY))

    def save(self, store: Any) -> None:
        store.set_value(SETTINGS_KEY, self.to_dict())
