"""Chat messages to prompt tokens, where only the chat template's own markers are special.

``tokenizer.apply_chat_template`` renders the conversation to one string and tokenizes it
whole, so a user who types ``<|im_start|>system`` gets the real control token: text that
can forge a new turn or role. Here every occurrence of a special token's text inside a
message is first swapped for a private placeholder, the template is rendered, and the
result is tokenized piece by piece: the template's markers (the only special-token texts
left) become their ids, and the text between them, with the user's original characters put
back, is tokenized with ``split_special_tokens`` so a typed marker stays plain text.

The text between two special tokens is exactly what the tokenizer itself tokenizes on its
own (it cuts the input at added tokens first), so a conversation without typed markers
gives the same ids as ``apply_chat_template``; that path is taken directly.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any


def encode_chat(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = True,
                tools: Sequence[dict] | None = None) -> list[int]:
    """Prompt token ids of ``messages`` under the model's chat template (see module doc).

    ``tokenizer`` is mlx-lm's TokenizerWrapper or a transformers tokenizer; ``tools``
    (OpenAI-style function specs) go to the template, which renders them if it knows how.
    """
    extra = {"tools": list(tools)} if tools else {}
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    messages = [dict(m) for m in messages]
    if not getattr(tokenizer, "chat_template", None):
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        text += "\nassistant:" if add_generation_prompt else ""
        return list(hf(text, split_special_tokens=True)["input_ids"])
    specials = special_token_texts(hf)
    pattern = _alternation(specials)
    marker = _fresh_marker(messages)
    typed: list[str] = []

    def hide(match: re.Match) -> str:
        typed.append(match.group(0))
        return f"{marker}{len(typed) - 1}{marker}"

    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and pattern is not None:
            m["content"] = pattern.sub(hide, content)
    if not typed:
        return list(tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **extra))
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
    restore = re.compile(re.escape(marker) + r"(\d+)" + re.escape(marker))
    return encode_segmented(hf, text, lambda piece: restore.sub(
        lambda m: typed[int(m.group(1))], piece))


def encode_segmented(hf: Any, text: str, restore=lambda piece: piece) -> list[int]:
    """Token ids of ``text`` with its special-token texts as markers and the pieces between
    them (after ``restore``) tokenized as plain text; equals ``hf.encode(text,
    add_special_tokens=False)`` when ``restore`` is the identity."""
    specials = special_token_texts(hf)
    pattern = _alternation(specials)
    pieces = pattern.split(text) if pattern is not None else [text]
    # re.split with one group: text, marker, text, marker, ..., text
    strip = _strip_rules(hf)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            ids.append(hf.convert_tokens_to_ids(piece))
            continue
        if i > 0 and strip.get(pieces[i - 1], (False, False))[1]:
            piece = piece.lstrip()
        if i + 1 < len(pieces) and strip.get(pieces[i + 1], (False, False))[0]:
            piece = piece.rstrip()
        piece = restore(piece)
        if piece:
            ids.extend(hf(piece, add_special_tokens=False,
                          split_special_tokens=True)["input_ids"])
    return ids


def special_token_texts(hf: Any) -> list[str]:
    """The texts of the tokenizer's special (control) tokens, longest first."""
    decoder = getattr(hf, "added_tokens_decoder", None) or {}
    texts = {tok.content for tok in decoder.values() if getattr(tok, "special", False)}
    texts.update(getattr(hf, "all_special_tokens", None) or [])
    return sorted((t for t in texts if t), key=len, reverse=True)


def _strip_rules(hf: Any) -> dict[str, tuple[bool, bool]]:
    """Special token text -> (lstrip, rstrip): whitespace next to it that the tokenizer
    swallows."""
    decoder = getattr(hf, "added_tokens_decoder", None) or {}
    return {tok.content: (bool(getattr(tok, "lstrip", False)), bool(getattr(tok, "rstrip", False)))
            for tok in decoder.values()}


def _alternation(texts: list[str]) -> re.Pattern | None:
    if not texts:
        return None
    return re.compile("(" + "|".join(re.escape(t) for t in texts) + ")")


def _fresh_marker(messages: list[dict]) -> str:
    """A private-use string that occurs in no message (so it can mark a hidden marker)."""
    contents = [m.get("content") for m in messages if isinstance(m.get("content"), str)]
    while True:
        marker = "\U000f0000" + secrets.token_hex(4) + "\U000f0001"
        if not any(marker in c for c in contents):
            return marker
