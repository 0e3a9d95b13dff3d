"""Model downloads (app/core/downloads.py) against a loopback Hugging Face Hub.

The hub (tests/hf_server.py) serves a tiny mlx-lm model made here, through the endpoints
huggingface_hub itself calls; HF_ENDPOINT points at it. The server's request log is the
witness of what was fetched: a resumed download asks for the rest of a file with a Range
header and never asks for a finished file again.
"""

from __future__ import annotations

import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from huggingface_hub import constants

from app.core import downloads
from app.core.downloads import Download, DownloadCancelled, DownloadError, Progress
from tests.hf_server import GOOD_TOKEN, LoopbackHub, free_port
from tests.reference import reference_model
from tests.tiny_model import make_tiny_model

REPO = "mlx-community/tiny-llama-test"
WEIGHTS = "model.safetensors"
CHUNK = 64 * 1024  # finer progress than the library's 10 MB chunks, on a 13 MB file


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hub") / "tiny", reference_model().path)


@pytest.fixture
def hub(model_folder, monkeypatch):
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    with LoopbackHub() as server:
        server.add(REPO, model_folder)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.is_file())
    return names == sorted(p.name for p in b.iterdir() if p.is_file()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def test_download_progress_is_monotonic_to_100_percent_and_the_model_generates(
        hub, model_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(downloads, "PROGRESS_INTERVAL_S", 0.0)  # every chunk reported
    seen: list[Progress] = []
    folder = Download(REPO, tmp_path, on_progress=seen.append).run()
    assert same_files(folder, model_folder)
    done = [p.done for p in seen]
    assert done == sorted(done)
    assert len(set(done)) > (model_folder / WEIGHTS).stat().st_size // CHUNK
    total = sum(p.stat().st_size for p in model_folder.iterdir())
    assert seen[-1].done == seen[-1].total == total and seen[-1].fraction == 1.0
    assert seen[-1].eta_s == 0.0
    assert any(p.speed > 0 for p in seen)
    assert not downloads.is_partial(folder)
    # The downloaded folder loads and generates as mlx-lm's own generation on the original.
    from engine import Engine, EngineConfig, SamplingParams
    from tests.reference import collect
    from tests.tiny_model import greedy_with_margin

    prompt = [1, 2, 3, 4, 5, 6, 7]
    expected, _ = greedy_with_margin(model_folder, prompt, 8)
    engine = Engine(EngineConfig(model=str(folder), kv_memory_mib=1, block_size=8))
    engine.start()
    try:
        assert engine.wait_ready(120), engine.load_error
        tokens, finals = collect(engine.submit(prompt_tokens=prompt, params=SamplingParams(
            temperature=0.0, max_tokens=8)))
    finally:
        engine.stop()
    assert tokens[0] == expected


def cancelled_a_third_in(model_folder: Path, root: Path, monkeypatch) -> Download:
    """A download cancelled (from its own progress callback) a third into the weights."""
    monkeypatch.setattr(downloads, "PROGRESS_INTERVAL_S", 0.0)
    size = (model_folder / WEIGHTS).stat().st_size
    first = Download(REPO, root)
    first.on_progress = lambda p: first.cancel() if p.file == WEIGHTS and \
        p.fetched > size // 3 else None
    with pytest.raises(DownloadCancelled):
        first.run()
    return first


def test_cancel_then_resume_fetches_only_the_missing_bytes(hub, model_folder, tmp_path,
                                                          monkeypatch):
    size = (model_folder / WEIGHTS).stat().st_size
    first = cancelled_a_third_in(model_folder, tmp_path, monkeypatch)
    had = _part(first)
    assert 0 < had < size and downloads.is_partial(first.folder)
    assert not (first.folder / WEIGHTS).exists()
    finished = [n for n in ("config.json", "tokenizer.json") if (first.folder / n).is_file()]
    assert finished == ["config.json", "tokenizer.json"]  # small files come first
    before = len(hub.state.log)

    seen: list[Progress] = []
    folder = Download(REPO, tmp_path, on_progress=seen.append).run()
    assert same_files(folder, model_folder)
    again = [r for r in hub.state.log[before:] if r.method == "GET" and "/resolve/" in r.path]
    assert [r.path.rsplit("/", 1)[1] for r in again] == [WEIGHTS]  # nothing finished again
    assert again[0].range == f"bytes={had}-" and again[0].sent == size - had
    assert seen[0].done >= had and seen[0].fetched == 0
    assert [p.done for p in seen] == sorted(p.done for p in seen)


def _part(d: Download) -> int:
    part = d.folder / (WEIGHTS + downloads.PART_SUFFIX)
    return part.stat().st_size if part.exists() else 0


def test_a_connection_dropped_mid_file_is_resumed_by_range(hub, model_folder, tmp_path):
    hub.state.drop_once[WEIGHTS] = 5 * CHUNK
    folder = Download(REPO, tmp_path).run()
    assert same_files(folder, model_folder)
    gets = hub.state.gets(WEIGHTS)
    assert [g.range for g in gets] == [None, f"bytes={5 * CHUNK}-"]


def test_a_server_error_mid_download_says_so_and_a_retry_completes(hub, model_folder, tmp_path):
    hub.state.fail[WEIGHTS] = 500
    with pytest.raises(DownloadError, match="HTTP 500 while sending model.safetensors"):
        Download(REPO, tmp_path).run()
    del hub.state.fail[WEIGHTS]
    folder = Download(REPO, tmp_path).run()
    assert same_files(folder, model_folder)


def test_a_full_disk_is_refused_before_any_byte_is_fetched(hub, tmp_path, monkeypatch):
    """Simulated at the check site only: the download's own disk_usage reports 10 MB free
    (no tiny filesystem here); the real file writes are never faked."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(downloads, "disk_usage", lambda _path: usage(10**12, 10**12, 10**7))
    with pytest.raises(DownloadError, match="Not enough disk space .* 10.0 MB free"):
        Download(REPO, tmp_path).run()
    assert not [r for r in hub.state.log if "/resolve/" in r.path]


@pytest.mark.parametrize("repo_id,message", [
    ("not a repo", "is not a Hugging Face repo id"),
    ("../etc/passwd", "is not a Hugging Face repo id"),
    ("mlx-community/does-not-exist", "No model 'mlx-community/does-not-exist'"),
])
def test_bad_repo_ids_get_a_clear_message(hub, tmp_path, repo_id, message):
    with pytest.raises(DownloadError, match=message):
        Download(repo_id, tmp_path).run()


def test_a_gated_repo_asks_for_the_token_and_downloads_with_it(hub, model_folder, tmp_path):
    hub.add("meta-llama/gated-tiny", model_folder, gated=True)
    with pytest.raises(DownloadError, match="gated model.*add your Hugging Face token"):
        Download("meta-llama/gated-tiny", tmp_path).run()
    with pytest.raises(DownloadError, match="gated model.*no access yet"):
        Download("meta-llama/gated-tiny", tmp_path, token="hf_wrong").run()
    folder = Download("meta-llama/gated-tiny", tmp_path, token=GOOD_TOKEN).run()
    assert same_files(folder, model_folder)


def test_no_network_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nobody listens
    with pytest.raises(DownloadError, match="Hugging Face cannot be reached") as refused:
        Download(REPO, tmp_path).run()
    # in words, no exception class names (it read "(ConnectError)"; issue 25 item 6)
    assert "(no connection)" in str(refused.value)
    assert not re.search(r"[A-Z][a-z]+(Error|Exception)", str(refused.value)), refused.value


def test_a_repo_that_is_no_mlx_lm_model_is_refused(hub, model_folder, tmp_path):
    torch = tmp_path / "torch-repo"
    torch.mkdir()
    shutil.copy(model_folder / "config.json", torch / "config.json")
    (torch / "pytorch_model.bin").write_bytes(b"\0" * 1000)
    hub.add("someone/pytorch-only", torch)
    with pytest.raises(DownloadError, match="not an mlx-lm model.*pytorch_model.bin"):
        Download("someone/pytorch-only", tmp_path / "dl").run()
    gguf = tmp_path / "no-config"
    gguf.mkdir()
    (gguf / "model.safetensors").write_bytes(b"\0" * 100)
    (gguf / "README.md").write_text("hi")
    hub.add("someone/no-config", gguf)
    with pytest.raises(DownloadError, match="not an mlx-lm model: it has no config.json"):
        Download("someone/no-config", tmp_path / "dl").run()
    assert not [r for r in hub.state.log if r.path.endswith("/" + WEIGHTS) and r.method == "GET"]


def test_a_part_of_a_file_that_changed_on_the_hub_is_started_again(hub, model_folder,
                                                                     tmp_path, monkeypatch):
    """A .part is continued only while the server's ETag is the one it was started with: a
    file replaced on the Hub meanwhile is fetched whole, never spliced onto old bytes."""
    first = cancelled_a_third_in(model_folder, tmp_path, monkeypatch)
    assert _part(first) > 0
    changed = make_tiny_model(tmp_path / "changed", reference_model().path, seed=1)
    hub.state.repos[REPO] = changed  # same commit id from this server, new file contents
    folder = Download(REPO, tmp_path).run()
    assert (folder / WEIGHTS).read_bytes() == (changed / WEIGHTS).read_bytes()
    assert hub.state.gets(WEIGHTS)[-1].range is None
