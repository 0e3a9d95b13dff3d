"""Constrained decoding: each constrained row's next-token mask, from its grammar.

A request with a :class:`~engine.config.Constraint` gets one llguidance ``LLMatcher`` per
sample (llguidance: a maintained Rust grammar engine with JSON Schema, regex and Lark
front ends; chosen over xgrammar, which needs PyTorch, and outlines-core, whose index is
built per regex up front and has no Lark or tool-call grammars). The matcher follows the
reply: every accepted token is consumed, so at any step it knows which tokens may come next.

Before a step samples, :meth:`Grammars.bitmasks` fills one packed bitmask row per
constrained row (32 tokens per int32, in llguidance's threads, not Python's), and
:func:`apply_bitmask` turns the rows the masks forbid to -inf on the device, before the
repetition penalty and the filters, so greedy and sampled rows alike only draw allowed
tokens. Rows without a constraint are not touched and pay nothing; a step with no
constrained row does none of this.

A mask needs the row's previous token consumed, so a step that samples a constrained row
is never launched ahead of the step before it (engine/runner/step.py reads the step in
flight first): constrained rows decode synchronously, the others overlap as before.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

from engine.config import Constraint


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for ``constraint``."""
    if constraint.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.loads(constraint.spec), defaults={"whitespace_flexible": False})
    if constraint.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults={"whitespace_flexible": False})
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    return llguidance.LLMatcher.grammar_from_lark(constraint.spec)


_BY_TOKENIZER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammars_for(tokenizer) -> Grammars:
    """The :class:`Grammars` of an mlx-lm tokenizer (built on first use: the llguidance
    tokenizer takes a moment to build from the vocabulary). A tokenizer llguidance cannot
    read raises ValueError, the same one every time (remembered, not rebuilt)."""
    grammars = _BY_TOKENIZER.get(tokenizer)
    if grammars is None:
        vocab = max(tokenizer.vocab_size, len(tokenizer._tokenizer))
        try:
            grammars = Grammars(tokenizer._tokenizer, vocab, sorted(tokenizer.eos_token_ids))
        except Exception as e:  # a tokenizer kind llguidance cannot read (e.g. word-level)
            grammars = ValueError(
                f"this model's tokenizer does not support constrained output "
                f"(structured output, regex, grammars, tool calls): {e}")
        _BY_TOKENIZER[tokenizer] = grammars
    if isinstance(grammars, ValueError):
        raise ValueError(str(grammars))
    return grammars


class Grammars:
    """The model's tokenizer as llguidance sees it, and the matchers built on it.

    ``vocab_size`` is the tokenizer's vocabulary; logits may be wider (padded embeddings):
    :func:`apply_bitmask` never allows a token past the mask.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.eos_ids = tuple(eos_ids)
        self._executor = llguidance.LLExecutor()
        self._words = (vocab_size + 31) // 32

    def check(self, constraint: Constraint) -> str:
        """The grammar for ``constraint``, or a ValueError with the compiler's message."""
        try:
            grammar = grammar_text(constraint)
        except Exception as e:  # the front end refused it (a bad schema, regex, grammar)
            raise ValueError(f"the {constraint.kind} constraint is not valid: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"the {constraint.kind} constraint is not valid: {error}")
        return grammar

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the start of a reply (one per sample)."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"the constraint could not start: {matcher.get_error()}")
        return matcher

    def bitmasks(self, matchers: Sequence[llguidance.LLMatcher]) -> np.ndarray:
        """[len(matchers), words] int32: bit t of row i set when token t may come next."""
        masks = np.empty((len(matchers), self._words), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, m in enumerate(matchers)], masks)
        return masks


def apply_bitmask(logits: mx.array, rows: mx.array | None, masks: mx.array) -> mx.array:
    """``logits`` [R, V] with the tokens ``masks`` ([len(rows), words] int32) forbid set to
    -inf in ``rows`` (None: every row); the other rows are returned as they were."""
    vocab = logits.shape[-1]
    ids = mx.arange(vocab, dtype=mx.uint32)
    covered = masks.shape[-1] * 32
    words = masks.astype(mx.uint32)[:, mx.minimum(ids >> 5, masks.shape[-1] - 1)]  # [n, V]
    allowed = ((words >> (ids & 31)) & 1).astype(mx.bool_)
    if vocab > covered:  # logits wider than the tokenizer: those tokens are never allowed
        allowed = allowed & (ids < covered)
    if rows is None:
        return mx.where(allowed, logits, -mx.inf)
    picked = logits[rows]
    logits[rows] = mx.where(allowed, picked, mx.array(-mx.inf, dtype=logits.dtype))
    return logits
