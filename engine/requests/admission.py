"""Admission: from a submitted conversation to a request the scheduler can run, or a refusal.

Runs on the engine thread (the tokenizer belongs to it). A request that cannot run gets one
sentence saying why and what to do, and never reaches the scheduler.
"""

from __future__ import annotations

from typing import Any

from engine.config import SamplingParams, check_top_k
from engine.handle import RequestHandle
from engine.models.chat_format import encode_chat
from engine.runner.constraints import grammars_for
from engine.runner.sampling import new_key
from engine.sched.beams import BeamGroup
from engine.sched.sequence import Request, Sequence


def apply_template(tokenizer: Any, messages: list[dict],
                   add_generation_prompt: bool = True, tools: list[dict] | None = None
                   ) -> list[int]:
    """The model's chat template when it has one, else a plain "role: content" layout;
    message text is always tokenized as text (engine/models/chat_format.py)."""
    return encode_chat(tokenizer, messages, add_generation_prompt, tools)


def admit(
    request_id: str,
    session_id: str,
    messages: list[dict] | None,
    prompt_tokens: list[int] | None,
    params: SamplingParams,
    handle: RequestHandle,
    tokenizer: Any,
    max_context: int,
) -> tuple[Request, str | None]:
    """The request with one sequence per sample (per beam for beam search: the first runs
    the prompt, the others wait to be forked from it), and None; or the request and why it
    cannot run (its prompt is set whenever it could be built, for the usage of the
    refusal)."""
    request = Request(request_id, session_id, params, [], handle)
    try:
        prompt = apply_template(tokenizer, messages) if messages is not None else prompt_tokens
    except Exception as e:
        return request, f"the conversation could not be formatted for this model: {e}"
    request.prompt = prompt
    if len(prompt) >= max_context:
        return request, (
            f"the prompt is {len(prompt)} tokens but the model's context limit is "
            f"{max_context}: shorten the conversation or start a new chat"
        )
    vocab = max(tokenizer.vocab_size, len(tokenizer))
    if any(t < 0 or t >= vocab for t in prompt):
        return request, "the prompt holds token ids outside the model's vocabulary"
    try:
        check_top_k(params, vocab)  # submit checks it too, once the model is loaded
    except ValueError as e:
        return request, str(e)
    grammar = None
    if params.constraint is not None:
        try:
            grammars = grammars_for(tokenizer)
            grammar = grammars.check(params.constraint)
            matchers = [grammars.matcher(grammar) for _ in range(params.n)]
        except ValueError as e:
            return request, str(e)
        request.grammars = grammars
    for index in range(params.num_sequences):
        request.sequences.append(
            Sequence(
                request=request,
                index=index,
                tokens=list(prompt),
                num_prompt=len(prompt),
                key=None if params.greedy or params.seed is None
                else new_key(params.seed, index),
                detokenizer=tokenizer.detokenizer,
            )
        )
        if grammar is not None:
            request.sequences[-1].matcher = matchers[index]
    if params.beam_search:
        request.beams = BeamGroup(request)
        request.beams.start(request.sequences[0])
    return request, None
