"""Downloading an mlx-lm model from Hugging Face: progress, cancel, resume, clear errors.

Everything on the wire goes through ``huggingface_hub``: ``HfApi.model_info`` lists the repo's
files with their sizes at one commit, ``get_hf_file_metadata`` (a HEAD) gives each file's
ETag, and ``http_get`` streams it with a ``Range`` header from the bytes already on disk,
retrying dropped connections itself. What this module adds is what a desktop app needs
around that:

* **resume after a cancel or a quit**: each file streams into ``<name>.part`` next to its
  final name, so a later run continues where the last one stopped. ``snapshot_download``
  cannot do this: since huggingface_hub 1.x it writes to a per-process temporary file and
  deletes it on any failure (``file_download._download_to_tmp_and_move``), so a cancelled
  4 GB weights file would start again from zero. A ``.part`` is only continued while the
  server's ETag for that file is the one it was started with (kept in a small manifest);
* **cancel** from any thread: the progress meter that ``http_get`` calls per chunk raises
  :class:`DownloadCancelled` on the download's worker thread;
* **a disk-space check before anything is fetched**, against what is still missing;
* **one sentence per failure** (:class:`DownloadError`): bad repo id, no such repo, gated,
  no network, a server error, not an mlx-lm model, no space.

Qt-free (``app/core``): the Models window runs :meth:`Download.run` on a worker thread and
turns :class:`Progress` callbacks into signals.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from shutil import disk_usage
from typing import Any

from engine import looks_like_repo_id

#: What an mlx-lm model folder is made of (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS, which
#: mlx_lm.load fetches too).
try:
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS as ALLOW_PATTERNS
except ImportError:  # pragma: no cover - mlx-lm is a dependency; kept for a clear list
    ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                      "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]

#: Left free after a download: a full disk breaks more than this download.
DISK_MARGIN_BYTES = 256 * 2**20
MANIFEST = ".pagedchat-download.json"
PART_SUFFIX = ".part"
#: Progress callbacks at most this often (plus one at each file's end and at 100%).
PROGRESS_INTERVAL_S = 0.1
SPEED_WINDOW_S = 3.0


class DownloadError(Exception):
    """A download that cannot go on; the message says why and what to do."""


class DownloadCancelled(Exception):
    """The user cancelled; what was fetched stays on disk and a new run resumes it."""


@dataclass(frozen=True)
class Progress:
    """Where a download stands. ``done`` counts bytes on disk for this model, resumed bytes
    included; ``fetched`` only those fetched by this run (what speed is measured on)."""

    repo_id: str
    done: int
    total: int
    fetched: int
    speed: float  # bytes/s over the last few seconds
    eta_s: float | None
    file: str

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0


def folder_for(root: Path, repo_id: str) -> Path:
    """Where ``repo_id`` is downloaded below ``root`` ("owner--name", as the HF cache says)."""
    return root / repo_id.replace("/", "--")


def is_partial(folder: Path) -> bool:
    """A download that was started and not finished (it can be resumed)."""
    return (folder / MANIFEST).is_file()


class Download:
    """One model download. :meth:`run` blocks (call it on a worker thread); :meth:`cancel`
    may be called from any thread."""

    def __init__(self, repo_id: str, root: Path, token: str | None = None,
                 endpoint: str | None = None,
                 on_progress: Callable[[Progress], None] | None = None) -> None:
        self.repo_id = repo_id.strip()
        self.root = Path(root)
        self.token = token or None
        # HF_ENDPOINT read now, not when huggingface_hub was imported (a mirror, the tests).
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None
        self.on_progress = on_progress
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._done = 0
        self._total = 0
        self._fetched = 0
        self._file = ""
        self._samples: deque[tuple[float, int]] = deque()
        self._last_report = 0.0

    @property
    def folder(self) -> Path:
        return folder_for(self.root, self.repo_id)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    # ---- the run ---------------------------------------------------------------------------

    def run(self) -> Path:
        """Download (or finish downloading) the model; returns its folder.

        Raises DownloadCancelled or DownloadError; never anything else for the user's causes.
        """
        if not looks_like_repo_id(self.repo_id):
            raise DownloadError(
                f"'{self.repo_id}' is not a Hugging Face repo id: it looks like owner/name, "
                "e.g. mlx-community/Qwen3-0.6B-4bit.")
        with _hub_errors(self.repo_id, self.token):
            commit, files = self._list_files()
        folder = self.folder
        folder.mkdir(parents=True, exist_ok=True)
        manifest = self._manifest(folder, commit)
        self._total = sum(files.values())
        self._done = sum(_on_disk(folder, name, size) for name, size in files.items())
        self._check_space(folder, self._total - self._done)
        self._report(force=True)
        # config.json first (a repo that is no mlx-lm model is told before its weights
        # come), then the smallest first: a cancel leaves every small file finished.
        for name in sorted(files, key=lambda n: (n != "config.json", files[n], n)):
            if self._cancel.is_set():
                raise DownloadCancelled(self.repo_id)
            with _hub_errors(self.repo_id, self.token, name):
                self._fetch(folder, name, files[name], manifest)
            if name == "config.json":
                _check_config(folder / name, self.repo_id)
        (folder / MANIFEST).unlink(missing_ok=True)
        self._report(force=True)
        return folder

    def _list_files(self) -> tuple[str, dict[str, int]]:
        from huggingface_hub import HfApi
        from huggingface_hub.utils import filter_repo_objects

        info = HfApi(endpoint=self.endpoint, token=self.token).model_info(
            self.repo_id, files_metadata=True)
        names = {s.rfilename: s.size for s in info.siblings or []}
        wanted = {n: int(names[n] or 0)
                  for n in filter_repo_objects(names, allow_patterns=ALLOW_PATTERNS)}
        if "config.json" not in wanted:
            raise DownloadError(
                f"'{self.repo_id}' is not an mlx-lm model: it has no config.json. Choose an "
                "MLX conversion (for example from mlx-community) or convert it with "
                "mlx_lm.convert.")
        if not any(n.endswith(".safetensors") for n in wanted):
            other = sorted(n for n in names if n.endswith((".gguf", ".bin", ".pt", ".pth")))
            kind = f" (it has {other[0]})" if other else ""
            raise DownloadError(
                f"'{self.repo_id}' is not an mlx-lm model: it has no model*.safetensors "
                f"weights{kind}. Choose an MLX conversion (for example from mlx-community) "
                "or convert it with mlx_lm.convert.")
        return str(info.sha), wanted

    def _manifest(self, folder: Path, commit: str) -> dict[str, Any]:
        """The ETags the .part files were started with, for this commit; parts of another
        commit or of unknown origin are dropped (they cannot be continued safely)."""
        path = folder / MANIFEST
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            manifest = {}
        if not isinstance(manifest, dict) or manifest.get("commit") != commit:
            for part in folder.glob(f"**/*{PART_SUFFIX}"):
                part.unlink()
            manifest = {"repo_id": self.repo_id, "commit": commit, "etags": {}}
        manifest["path"] = path
        self._write_manifest(manifest)
        return manifest

    @staticmethod
    def _write_manifest(manifest: dict[str, Any]) -> None:
        data = {k: v for k, v in manifest.items() if k != "path"}
        manifest["path"].write_text(json.dumps(data, indent=1), encoding="utf-8")

    def _check_space(self, folder: Path, missing: int) -> None:
        free = disk_usage(folder).free
        if missing + DISK_MARGIN_BYTES > free:
            raise DownloadError(
                f"Not enough disk space for {self.repo_id}: it needs {_size(missing)} more "
                f"(plus {_size(DISK_MARGIN_BYTES)} to spare) and the disk of {folder} has "
                f"{_size(free)} free. Free some space, or remove models you no longer use.")

    def _fetch(self, folder: Path, name: str, size: int, manifest: dict[str, Any]) -> None:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers

        target = folder / name
        if target.is_file() and target.stat().st_size == size:
            return
        self._file = name
        url = hf_hub_url(self.repo_id, name, revision=manifest["commit"], endpoint=self.endpoint)
        meta = get_hf_file_metadata(url, token=self.token, endpoint=self.endpoint)
        part = target.with_name(target.name + PART_SUFFIX)
        part.parent.mkdir(parents=True, exist_ok=True)
        if manifest["etags"].get(name) != meta.etag and part.exists():
            # Another version of this file (or one we cannot vouch for): start it again.
            self._done -= part.stat().st_size
            part.unlink()
        manifest["etags"][name] = meta.etag
        self._write_manifest(manifest)
        resume = part.stat().st_size if part.exists() else 0
        headers = build_hf_headers(token=self.token)
        headers["Accept-Encoding"] = "identity"
        with part.open("ab") as f:
            http_get(meta.location, f, resume_size=resume, headers=headers,
                     expected_size=meta.size if meta.size is not None else size,
                     displayed_filename=name, tqdm_class=self._meter)
        part.replace(target)
        self._report(force=True)

    # ---- progress --------------------------------------------------------------------------

    def _meter(self, **_kwargs: Any) -> _Meter:
        """What http_get takes for a tqdm class: a callable returning a progress object."""
        return _Meter(self)

    def _advance(self, n: int) -> None:
        """``n`` more bytes written (http_get's progress calls, on the worker thread)."""
        if self._cancel.is_set():
            raise DownloadCancelled(self.repo_id)
        now = time.monotonic()
        with self._lock:
            self._done += n
            self._fetched += n
            self._samples.append((now, n))
        self._report()

    def progress(self) -> Progress:
        now = time.monotonic()
        with self._lock:
            while self._samples and self._samples[0][0] < now - SPEED_WINDOW_S:
                self._samples.popleft()
            span = now - self._samples[0][0] if len(self._samples) > 1 else 0.0
            speed = sum(n for _, n in self._samples) / span if span > 0.05 else 0.0
            remaining = max(self._total - self._done, 0)
            eta = remaining / speed if speed > 0 else (0.0 if not remaining else None)
            return Progress(self.repo_id, self._done, self._total, self._fetched, speed, eta,
                            self._file)

    def _report(self, force: bool = False) -> None:
        if self.on_progress is None:
            return
        now = time.monotonic()
        if not force and now - self._last_report < PROGRESS_INTERVAL_S:
            return
        self._last_report = now
        self.on_progress(self.progress())


class _Meter:
    """The progress object http_get drives (tqdm's update / context-manager interface)."""

    def __init__(self, download: Download) -> None:
        self._download = download

    def update(self, n: int | float | None = 1) -> None:
        self._download._advance(int(n or 0))

    def __enter__(self) -> _Meter:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        return None

    def set_postfix_str(self, *args: object, **kwargs: object) -> None:
        return None


def _on_disk(folder: Path, name: str, size: int) -> int:
    """Bytes of ``name`` already here: the whole file, or its .part so far."""
    target = folder / name
    if target.is_file() and target.stat().st_size == size:
        return size
    part = target.with_name(target.name + PART_SUFFIX)
    return min(part.stat().st_size, size) if part.is_file() else 0


def _check_config(path: Path, repo_id: str) -> None:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DownloadError(f"The config.json of '{repo_id}' cannot be read ({e}): it is not "
                            "an mlx-lm model.") from e
    if not isinstance(config, dict) or not config.get("model_type"):
        raise DownloadError(f"'{repo_id}' is not an mlx-lm model: its config.json names no "
                            "model_type. Choose an MLX conversion (for example from "
                            "mlx-community).")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class _hub_errors:
    """Turns huggingface_hub's and the network's exceptions into one DownloadError each."""

    def __init__(self, repo_id: str, token: str | None, file: str | None = None) -> None:
        self.repo_id, self.token, self.file = repo_id, token, file

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, _tb: object) -> bool:
        if error is None or isinstance(error, DownloadError | DownloadCancelled):
            return False
        import httpx2
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        repo = self.repo_id
        if isinstance(error, GatedRepoError):
            fix = ("your Hugging Face token has no access yet: accept the model's licence on "
                   "its page at huggingface.co" if self.token else
                   "accept its licence at huggingface.co, then add your Hugging Face token in "
                   "Settings (it is kept in the system keychain)")
            message = f"'{repo}' is a gated model: {fix}."
        elif isinstance(error, RepositoryNotFoundError):
            message = (f"No model '{repo}' on Hugging Face (or it is private): check the "
                       "spelling of the repo id" + ("" if self.token else
                                                    ", or add your token in Settings") + ".")
        elif isinstance(error, RevisionNotFoundError | RemoteEntryNotFoundError):
            what = self.file or "the revision"
            message = (f"A file of '{repo}' is no longer on Hugging Face ({what}): start the "
                       "download again.")
        elif isinstance(error, httpx2.ConnectError | httpx2.TimeoutException |
                        httpx2.NetworkError | httpx2.RemoteProtocolError):
            why = ("it took too long to answer" if isinstance(error, httpx2.TimeoutException)
                   else "the connection broke off" if isinstance(
                       error, httpx2.RemoteProtocolError | httpx2.ReadError)
                   else "no connection")  # in words: an exception's class name is jargon
            message = (f"Hugging Face cannot be reached ({why}): check your network "
                       "connection, then download again; what was fetched is kept.")
        elif isinstance(error, HfHubHTTPError):
            status = error.response.status_code if error.response is not None else "?"
            message = (f"Hugging Face answered HTTP {status} while sending "
                       f"{self.file or 'the file list'} of '{repo}': try again later; the "
                       "download resumes where it stopped.")
        elif isinstance(error, OSError) and "Consistency check failed" in str(error):
            message = (f"{self.file or 'A file'} of '{repo}' arrived incomplete: click "
                       "Download again to resume it.")
        elif isinstance(error, OSError):
            message = f"Writing '{repo}' to disk failed: {error}."
        else:
            return False
        raise DownloadError(message) from error
