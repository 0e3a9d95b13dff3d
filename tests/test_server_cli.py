"""`pagedchat serve` as a user runs it: a real process with no display, its key from the
keychain or the environment, the URL printed when ready, and a clean stop on SIGTERM that
ends an open stream with a final chunk. Every process here is bounded in time."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading

import keyring
import openai
import pytest

from app.server import keys

SERVE_TIMEOUT_S = 600
KEY = "pc-cli-test-key"


def serve_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY",
                                                            "QT_QPA_PLATFORM")}
    env.pop(keys.ENV_VAR, None)
    env.update(extra)
    return env


def run_serve(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "app.main", "serve", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=env or serve_env(), cwd=os.getcwd())


class Lines:
    """A child's stdout, read by a thread; ``wait_for`` blocks on an Event, not a sleep."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self.lines.append("")  # EOF
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        def found():
            for line in self.lines:
                if m := re.search(pattern, line):
                    return m
            return "" in self.lines and "EOF"

        with self._cond:
            result = self._cond.wait_for(found, timeout)
        if not isinstance(result, re.Match):
            raise AssertionError(f"{pattern!r} not printed; output: {''.join(self.lines)}")
        return result


@pytest.mark.model
def test_serve_streams_with_no_display_and_sigterm_ends_the_stream_cleanly() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.main", "serve", "--port", "0", "--kv-memory-mib", "32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=serve_env(PAGEDCHAT_API_KEY=KEY), cwd=os.getcwd())
    try:
        out = Lines(proc.stdout)
        url = out.wait_for(r"at (http://127\.0\.0\.1:\d+/v1)", SERVE_TIMEOUT_S).group(1)
        maps = f"/proc/{proc.pid}/maps"
        if os.path.exists(maps):  # Linux: prove no Qt library is even loaded
            with open(maps) as f:
                assert not re.search(r"PySide6|libQt6", f.read())
        client = openai.OpenAI(base_url=url, api_key=KEY, timeout=120, max_retries=0)
        stream = client.completions.create(
            model="default", prompt="Once upon a time", temperature=0, max_tokens=2000,
            stream=True)
        texts, finishes = [], []
        for chunk in stream:
            texts.append(chunk.choices[0].text)
            finishes.append(chunk.choices[0].finish_reason)
            if len(texts) == 3:
                proc.send_signal(signal.SIGTERM)
        assert finishes[-1] == "cancelled" and not any(finishes[:-1])
        assert 3 <= len(texts) < 2000
        assert proc.wait(timeout=60) == 0
        out.wait_for(r"server stopped", 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_the_serve_path_imports_no_qt() -> None:
    code = (
        "import sys, engine, app.server, app.server.cli\n"
        "from app.main import main\n"
        "assert main(['serve', '--api-key', 'k', '--show-key']) == 0\n"
        "print(sorted(m for m in sys.modules if m.startswith(('PySide6', 'qasync'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=serve_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["k", "[]"]


def test_another_address_needs_an_explicit_flag_and_warns() -> None:
    refused = run_serve("--host", "0.0.0.0", "--api-key", KEY)
    assert refused.returncode == 2 and "--allow-remote" in refused.stderr
    allowed = run_serve("--host", "0.0.0.0", "--port", "0", "--allow-remote", "--api-key", KEY,
                        "--model", "/nonexistent/model-folder")
    assert "WARNING" in allowed.stderr and "other machines" in allowed.stderr
    assert allowed.returncode == 1 and "did not load" in allowed.stderr


def test_a_busy_port_fails_at_once_with_a_clear_message() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = run_serve("--port", str(port), "--api-key", KEY)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr


def test_the_key_is_generated_once_into_the_keychain(app_env, monkeypatch) -> None:
    monkeypatch.delenv(keys.ENV_VAR, raising=False)
    assert keyring.get_password(keys.KEYCHAIN_SERVICE, keys.KEYCHAIN_USER) is None
    key, source = keys.resolve_key()
    assert source == "keychain" and key.startswith(keys.KEY_PREFIX) and len(key) > 40
    assert keyring.get_password(keys.KEYCHAIN_SERVICE, keys.KEYCHAIN_USER) == key
    assert keys.resolve_key() == (key, "keychain")
    shown = run_serve("--show-key", env=serve_env(
        PYTHON_KEYRING_BACKEND=os.environ["PYTHON_KEYRING_BACKEND"],
        XDG_DATA_HOME=os.environ["XDG_DATA_HOME"]))
    assert shown.stdout.strip() == key
    monkeypatch.setenv(keys.ENV_VAR, "from-env")
    assert keys.resolve_key() == ("from-env", keys.ENV_VAR)
    assert keys.resolve_key("given") == ("given", "--api-key")


def test_no_keychain_and_no_key_is_a_clear_error() -> None:
    result = run_serve(env=serve_env(PYTHON_KEYRING_BACKEND="keyring.backends.fail.Keyring"))
    assert result.returncode == 2
    assert "--api-key" in result.stderr and keys.ENV_VAR in result.stderr


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (f"Bearer {KEY}", True),
        (f"bearer {KEY}", True),
        (f"Bearer {KEY}x", False),
        (f"Bearer {KEY[:-1]}", False),
        (KEY, False),
        (f"Basic {KEY}", False),
        ("", False),
        (None, False),
    ],
)
def test_bearer_check(header, ok) -> None:
    assert keys.bearer_matches(header, KEY) is ok


def test_the_bundle_spec_keeps_the_server_stack() -> None:
    """uvicorn and anyio load these by name; a bundle without them fails at Run API Server."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = Path(__file__).parent.parent / "packaging" / "pagedchat.spec"
    tree = ast.parse(spec.read_text(encoding="utf-8"))
    values = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)}
    excludes = ast.literal_eval(values["EXCLUDES"])
    for package in ("uvicorn", "starlette", "sse_starlette", "anyio", "h11"):
        assert package not in excludes
    modules = ast.literal_eval(values["SERVER_MODULES"])
    for name in modules:
        assert importlib.util.find_spec(name) is not None, name
    import uvicorn.config

    chosen = uvicorn.config.Config(app=None, lifespan="off", ws="none")
    assert chosen.http == "auto" and chosen.loop == "auto"
    assert {"uvicorn.protocols.http.h11_impl", "uvicorn.loops.asyncio"} <= set(modules)
