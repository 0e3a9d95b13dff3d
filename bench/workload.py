"""The multi-chat workload the engine benchmarks run: a scaled-down multi-turn chat.

Several sessions share one system prompt; each has a few turns; every turn's prompt is the
whole conversation so far (as a chat app sends it). Seeded, so every run is the same.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYSTEM_PROMPT = (
    "You are PagedChat's assistant. Answer clearly and briefly. Prefer short paragraphs and "
    "concrete examples. If a question is ambiguous, say what you assume before answering."
)

TOPICS = [
    "how bread rises", "why the sky is blue", "how a bicycle stays upright",
    "what a compiler does", "how tides work", "why cats purr", "how vaccines work",
    "what makes music sound sad", "how a refrigerator keeps food cold",
    "why leaves change colour", "how airplanes fly", "what a black hole is",
]
FOLLOW_UPS = [
    "Can you give a simple example?", "Explain that to a ten year old.",
    "What is a common misconception about it?", "Summarise that in one sentence.",
]


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: list[str]


def make_sessions(count: int, turns: int, seed: int = 0) -> list[Session]:
    rng = random.Random(seed)
    sessions = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        messages = [f"Tell me {topic}."] + rng.sample(FOLLOW_UPS, k=turns - 1)
        sessions.append(Session(f"chat-{i}", messages))
    return sessions


def conversation(system: str, turns: list[str], replies: list[str]) -> list[dict]:
    """Messages for the next turn: the system prompt, earlier turns with their replies,
    then the newest user message."""
    messages = [{"role": "system", "content": system}]
    for question, answer in zip(turns, replies):
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": turns[len(replies)]})
    return messages
