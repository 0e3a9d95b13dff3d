"""Model loading: what a model spec names, resolved to a loaded mlx-lm model.

A spec is ``"default"`` (the embedded SmolLM2, engine/models/default_model.py), a local mlx-lm
folder (engine/models/folder.py), or a Hugging Face repo id, downloaded here first so that
"no such repo" and "no network" get their own fix. Every failure is a ``ModelLoadError``
whose message says what to do (docs/ARCHITECTURE.md §5).
"""

from __future__ import annotations

from pathlib import Path

from engine.config import looks_like_repo_id
from engine.errors import ModelLoadError, first_line
from engine.models.default_model import load_default_model
from engine.models.folder import LoadedModel, load_folder

DEFAULT_SPEC = "default"


def load_model(spec: str, quantized: bool | None = None) -> LoadedModel:
    """Load ``spec``: "default", a local mlx-lm folder, or a Hugging Face repo id.

    ``quantized`` only concerns the default model (other models come as they were saved):
    None picks what is fastest on this backend (see :func:`default_quantized`).
    """
    if spec == DEFAULT_SPEC:
        return load_default_model(quantized)
    path = Path(spec).expanduser()
    if path.exists() or not looks_like_repo_id(spec):
        return load_folder(path, name=path.name)
    return load_folder(download_repo(spec), name=spec)


def download_repo(repo_id: str) -> Path:
    """Fetch (or find in the Hugging Face cache) the files mlx-lm needs for ``repo_id``.

    Done apart from loading so that "no such repo" and "no network" get their own fix.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except GatedRepoError as e:
        raise ModelLoadError(
            f"The model '{repo_id}' is gated on Hugging Face: accept its licence on the "
            "website and add your Hugging Face token in Settings.") from e
    except RepositoryNotFoundError as e:
        raise ModelLoadError(
            f"The model '{repo_id}' was not found on Hugging Face (or it is private): check "
            "the repo id, or pass a local mlx-lm folder.") from e
    except LocalEntryNotFoundError as e:
        raise ModelLoadError(
            f"Could not download the model '{repo_id}': Hugging Face is unreachable and the "
            "model is not in the local cache. Connect to the network once, or pass a local "
            "mlx-lm folder.") from e
    except Exception as e:  # HTTP, disk and hub errors all end here
        raise ModelLoadError(
            f"Could not download the model '{repo_id}' from Hugging Face "
            f"({type(e).__name__}: {first_line(e)}). Check the repo id and your network "
            "connection, or pass a local mlx-lm folder.") from e
