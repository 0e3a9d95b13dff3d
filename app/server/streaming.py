"""Engine events -> OpenAI response objects, whole or as SSE chunks (framed by sse-starlette).

One ``Reply`` per HTTP request knows its kind (chat or text completion), id, model and the
usage it has gathered; it turns each engine event into the chunk a client expects, in order,
and ends every stream with the finish chunks, the optional usage chunk and ``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine import FinalEvent, FinishReason, TokenEvent, TokenLogprob

# The engine's reasons -> OpenAI's; "cancelled" (the server is shutting down) has no OpenAI
# equivalent and is passed through so a client can tell a cut reply from a finished one.
FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "cancelled",
    FinishReason.ERROR: "error",
}


@dataclass
class Reply:
    chat: bool
    model: str
    n: int
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    finals: dict[int, FinalEvent] = field(default_factory=dict)
    #: a token id's text (the engine's decode of it alone), for log-probabilities
    token_text: Callable[[int], str] = str
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    text_offsets: dict[int, int] = field(default_factory=dict)
    #: a new CallSplitter (app/server/tools.py) when the reply may hold tool calls
    splitter: Callable[[], Any] | None = None
    _splitters: dict[int, Any] = field(default_factory=dict)
    _content: dict[int, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    # ---- usage ------------------------------------------------------------------------------

    def usage(self) -> dict:
        finals = list(self.finals.values())
        prompt = max((f.usage.prompt_tokens for f in finals), default=0)
        cached = max((f.usage.cached_prompt_tokens for f in finals), default=0)
        completion = sum(f.usage.generated_tokens for f in finals)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def error(self) -> str | None:
        """The first sample's error, if any sample failed."""
        for index in sorted(self.finals):
            if self.finals[index].finish_reason == FinishReason.ERROR:
                return self.finals[index].error or "generation failed"
        return None

    # ---- whole responses --------------------------------------------------------------------

    def body(self) -> dict:
        choices = []
        for index in sorted(self.finals):
            final = self.finals[index]
            choice: dict = {
                "index": index,
                "finish_reason": FINISH_REASONS[final.finish_reason],
                "logprobs": self._logprobs(self.logprobs.get(index), offset=0),
            }
            if self.chat:
                choice["message"] = {"role": "assistant", "content": final.text}
                if self.splitter is not None:
                    splitter = self._split(index)
                    content, _ = splitter.feed("", final=True)
                    text = "".join(self._content.get(index, [])) + content
                    choice["message"]["content"] = text if text or not splitter.calls else None
                    if splitter.calls:
                        choice["message"]["tool_calls"] = splitter.calls
                        choice["finish_reason"] = self._finish(final)
            else:
                choice["text"] = final.text
            choices.append(choice)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "system_fingerprint": None,
        }

    # ---- chunks -----------------------------------------------------------------------------

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        chunk: dict = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if self.include_usage:
            chunk["usage"] = usage
        return json.dumps(chunk, ensure_ascii=False)

    def _choice(self, index: int, text: str | None, finish: str | None,
                role: bool = False, logprobs: list[TokenLogprob] | None = None) -> dict:
        entries = self._logprobs(logprobs, offset=self.text_offsets.get(index, 0))
        if logprobs and not self.chat:
            self.text_offsets[index] = self.text_offsets.get(index, 0) + sum(
                len(self.token_text(e.token_id)) for e in logprobs)
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": entries}
        return {"index": index, "text": text or "", "finish_reason": finish, "logprobs": entries}

    # ---- log-probabilities ------------------------------------------------------------------

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, entries: list[TokenLogprob] | None, offset: int) -> dict | None:
        """OpenAI's logprobs object for ``entries`` (None when the request asked for none):
        chat's ``content`` list, or completions' parallel lists, their text offsets counted
        from ``offset``."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [
                {**self._entry(e.token_id, e.logprob),
                 "top_logprobs": [self._entry(t, v) for t, v in e.top]} for e in entries],
                "refusal": None}
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): v for t, v in e.top} for e in entries],
                "text_offset": offsets}

    def opening_chunks(self) -> list[str]:
        """Chat streams start with the assistant role for each choice, as OpenAI's do."""
        if not self.chat:
            return []
        return [self._chunk([self._choice(i, "", None, role=True)]) for i in range(self.n)]

    def event_chunks(self, event: TokenEvent | FinalEvent) -> list[str]:
        if isinstance(event, TokenEvent) and self.splitter is not None:
            return self._split_chunks(event)
        if isinstance(event, TokenEvent):
            if event.logprobs is not None:
                self.logprobs.setdefault(event.index, []).extend(event.logprobs)
                # a held-back token (a possible stop string) still reports its logprob
                return [self._chunk([self._choice(event.index, event.text, None,
                                                  logprobs=list(event.logprobs))])]
            return [self._chunk([self._choice(event.index, event.text, None)])] if event.text \
                else []
        self.finals[event.index] = event
        if event.finish_reason == FinishReason.ERROR:
            return [json.dumps({"error": {
                "message": event.error or "generation failed", "type": "server_error",
                "param": None, "code": "generation_failed",
            }})]
        calls = []
        if self.splitter is not None:  # the rest of the text: content, or a last call
            content, calls = self._split(event.index).feed("", final=True)
            self._content.setdefault(event.index, []).append(content)
            chunks = [self._chunk([self._choice(event.index, content, None)])] if content \
                else []
            chunks += self._call_chunks(event.index, calls)
            return [*chunks, self._chunk([self._choice(event.index, None, self._finish(event))])]
        return [self._chunk([self._choice(event.index, None if self.chat else "",
                                          FINISH_REASONS[event.finish_reason])])]

    # ---- tool calls -------------------------------------------------------------------------

    def _split(self, index: int):
        if index not in self._splitters:
            self._splitters[index] = self.splitter()
        return self._splitters[index]

    def _finish(self, final: FinalEvent) -> str:
        """``tool_calls`` when the sample called a tool and ended on its own."""
        splitter = self._splitters.get(final.index)
        if splitter is not None and splitter.calls and final.finish_reason == FinishReason.STOP:
            return "tool_calls"
        return FINISH_REASONS[final.finish_reason]

    def _split_chunks(self, event: TokenEvent) -> list[str]:
        """A token event of a reply that may call tools: its content as far as it is sure
        not to start a call, then each call it completed (one delta with the whole call)."""
        content, calls = self._split(event.index).feed(event.text)
        self._content.setdefault(event.index, []).append(content)
        chunks = [self._chunk([self._choice(event.index, content, None)])] if content else []
        return chunks + self._call_chunks(event.index, calls)

    def _call_chunks(self, index: int, calls: list[dict]) -> list[str]:
        done = len(self._splitters[index].calls) - len(calls)
        chunks = []
        for k, call in enumerate(calls):
            delta = {"tool_calls": [{"index": done + k, **call}]}
            chunks.append(self._chunk([{"index": index, "delta": delta, "finish_reason": None,
                                        "logprobs": None}]))
        return chunks

    def closing_chunks(self) -> list[str]:
        tail = [self._chunk([], usage=self.usage())] if self.include_usage else []
        return [*tail, "[DONE]"]


async def sse_events(
    reply: Reply, first: TokenEvent | FinalEvent, events: AsyncIterator
) -> AsyncIterator[dict]:
    """The SSE ``data`` payloads of one stream; ``events`` goes on after ``first``."""
    for chunk in reply.opening_chunks():
        yield {"data": chunk}
    for chunk in reply.event_chunks(first):
        yield {"data": chunk}
    async for event in events:
        for chunk in reply.event_chunks(event):
            yield {"data": chunk}
    for chunk in reply.closing_chunks():
        yield {"data": chunk}
