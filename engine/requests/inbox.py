"""What other threads put in the engine's inbox, and how the engine thread applies it.

The inbox is the only way into the engine thread (docs/ARCHITECTURE.md §3.8): ``submit``,
``cancel`` and ``stop`` put messages here and return at once. The thread applies them
between steps, so the scheduler and the output never see two threads. Each function here
handles one message and contains its own failures: a submission that cannot start ends
with an error final for that request alone.
"""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass

from engine.config import Priority, SamplingParams
from engine.events import FinishReason
from engine.handle import RequestHandle
from engine.requests.admission import admit
from engine.runner.output import Output, refuse
from engine.runner.telemetry import Telemetry
from engine.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submit:
    request_id: str
    session_id: str
    messages: list[dict] | None
    prompt_tokens: list[int] | None
    params: SamplingParams
    handle: RequestHandle
    priority: Priority = Priority.NORMAL
    incognito: bool = False


@dataclass(frozen=True)
class SetPriority:
    session_id: str
    priority: Priority


@dataclass(frozen=True)
class Cancel:
    handle: RequestHandle | None = None  # one request (by handle: ids may be reused)
    session_id: str | None = None


@dataclass(frozen=True)
class Context:
    """Something done to a conversation's cached context (engine/runner/disk_sync.py):
    ``action`` "sleep" (out of the pool, onto the disk tier), "forget" (deleted, but for
    the blocks ``keep`` shares) or "pin" (kept warm under ``key``; ``unpin``: no more)."""

    action: str
    tokens: tuple[int, ...]
    keep: tuple[tuple[int, ...], ...] = ()
    key: str = ""
    unpin: bool = False


STOP = object()  # ends the thread's loop; everything queued behind it is answered
WAKE = object()  # wakes a sleeping thread (the disk tier's reader answered); nothing else


def answer_queued(inbox: queue.Queue, reason: FinishReason, message: str | None,
                  until_stop: bool = False) -> None:
    """End every queued submission with ``reason`` (the engine cannot serve them)."""
    while True:
        try:
            item = inbox.get(block=until_stop)
        except queue.Empty:
            return
        if item is STOP:
            return
        if isinstance(item, Submit):
            refuse(item.handle, item.params.n, reason, message)


def accept(item: Submit, tokenizer, max_context: int, scheduler: Scheduler, output: Output,
           telemetry: Telemetry) -> None:
    """Admit one submission; whatever goes wrong ends this request alone, with an error
    final for each of its samples, and never reaches the loop's catch-all."""
    try:
        request, refusal = admit(
            item.request_id, item.session_id, item.messages, item.prompt_tokens,
            item.params, item.handle, tokenizer, max_context,
        )
        if refusal is None and item.params.beam_search:
            refusal = beam_refusal(item.params, scheduler)
        if refusal is not None:
            refuse(item.handle, item.handle.n, FinishReason.ERROR, refusal, request)
            return
        request.priority = item.priority
        request.incognito = item.incognito
        scheduler.add(request.sequences[0])  # samples 1.. fork after the prompt
    except Exception as e:
        logger.exception("request %s could not be accepted", item.request_id)
        refuse(item.handle, item.handle.n, FinishReason.ERROR,
               f"the request could not be started: {type(e).__name__}: {e}")
        return
    output.requests[request.request_id] = request
    telemetry.add_session(item.session_id)
    if item.incognito:  # the snapshot marks the chat (SessionStats.incognito)
        telemetry.incognito.add(item.session_id)


def beam_refusal(params: SamplingParams, scheduler) -> str | None:
    """Why this engine cannot run a beam search of ``params``, or None. The beams need the
    paged pool (they fork and share blocks) and all of them in one batch."""
    if not isinstance(scheduler, Scheduler):
        return ("beam search needs the paged KV pool, and this model runs on mlx-lm's own "
                "cache: set beam_width to 1")
    if params.beam_width > scheduler.max_batch:
        return (f"beam_width {params.beam_width} is more than the engine's max_batch "
                f"({scheduler.max_batch}): the beams decode side by side in one batch")
    return None


def set_priority(item: SetPriority, scheduler: Scheduler, telemetry: Telemetry) -> None:
    """A session's live requests take a new priority (the user focused or left its pane)."""
    scheduler.set_priority(item.session_id, item.priority)
    telemetry.set_priority(item.session_id, item.priority)


def cancel(item: Cancel, output: Output, telemetry: Telemetry) -> None:
    """Cancel one request (matched by its handle) or every request of a session."""
    if item.handle is not None:
        request = output.requests.get(item.handle.request_id)
        if request is not None and request.handle is item.handle:
            output.finish_request(request, FinishReason.CANCELLED)
        return
    requests = output.requests.values()
    for request in [r for r in requests if r.session_id == item.session_id]:
        output.finish_request(request, FinishReason.CANCELLED)
    telemetry.forget_session(item.session_id)
