"""What the server tests share: one small real engine and one real server per module, and
the official `openai` client pointed at it (docs/CONTRIBUTING.md: servers bind 127.0.0.1 on
a free port, every call has a timeout, and the server stops itself when its module ends).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import openai

from app.server import ServerOptions, ServerThread, create_app
from engine import Engine, EngineConfig

KEY = "pc-test-key-0123456789"
TIMEOUT_S = 300.0


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@contextmanager
def running_engine(max_batch: int = 8) -> Iterator[Engine]:
    """The default model on a 64 MiB pool of 16-token blocks, eight chats a step unless
    ``max_batch`` says otherwise."""
    engine = Engine(EngineConfig(kv_memory_mib=64, block_size=16, max_batch=max_batch))
    engine.start()
    try:
        assert engine.wait_ready(600), engine.load_error
        yield engine
    finally:
        engine.stop()


@contextmanager
def running_server(engine: Engine, **options) -> Iterator[ServerThread]:
    """``pagedchat serve`` over ``engine`` in its own thread, with the tests' API key."""
    thread = ServerThread(create_app(engine, ServerOptions(api_key=KEY, **options)))
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()


def openai_client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=KEY, timeout=TIMEOUT_S, max_retries=0)


def model_id(engine: Engine) -> str:
    """The API's id of the served model: the app's one name for it (no spaces, no variant)."""
    from app.core.model_names import model_id as app_model_id

    return app_model_id(engine.model_info.name)
