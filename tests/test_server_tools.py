# ruff: noqa: F811  (test functions take the imported fixtures by name)
"""Function calling through ``pagedchat serve`` with the official ``openai`` client
(app/server/tools.py): the default model has no tool format of its own, so it is told about
the tools in the common format, and ``required`` / a named function holds its reply to a
grammar of valid calls.

References: ``jsonschema`` validates every call's arguments against its tool's parameters;
the streamed calls equal the whole reply's; the splitter is checked on hand-written text.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from app.server.tools import CallSplitter, CallSyntax

# The server fixtures of tests/test_server.py (one engine and server for these tests too).
from tests.test_server import client, engine, model_id, server, user  # noqa: F401

pytestmark = pytest.mark.model

BOOKING = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "nights": {"type": "integer", "minimum": 1, "maximum": 14},
        "room": {"enum": ["single", "double", "suite"]},
        "guests": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                             "age": {"type": "integer", "minimum": 0,
                                                     "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False}},
    },
    "required": ["city", "nights", "room", "guests"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "book_hotel", "description": "Book a hotel room",
                                      "parameters": BOOKING}},
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "Today's weather in a city",
                                      "parameters": WEATHER}},
]
SCHEMAS = {"book_hotel": BOOKING, "get_weather": WEATHER}
ASK = user("Book a double room in Lisbon for 3 nights for Ana (34) and Rui (36).")


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_returns_a_valid_call_streamed_and_not(client, engine):
    reply = client.chat.completions.create(
        model=model_id(engine), messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)
    chunks = list(client.chat.completions.create(
        model=model_id(engine), messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=200, stream=True))
    streamed = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls
                for tc in c.choices[0].delta.tool_calls]
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [
        (tc.function.name, tc.function.arguments) for tc in choice.message.tool_calls]
    assert [tc.index for tc in streamed] == list(range(len(streamed)))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_calls_each_validate(client, engine):
    """Greedy SmolLM2 repeats its call until max_tokens: every complete call is returned,
    each valid, and the reply says it was cut (length)."""
    reply = client.chat.completions.create(
        model=model_id(engine), messages=ASK, tools=TOOLS, tool_choice="required",
        temperature=0, max_tokens=250)
    calls = reply.choices[0].message.tool_calls
    check_calls(calls)
    assert len(calls) >= 2
    assert reply.choices[0].finish_reason in ("tool_calls", "length")


def test_a_named_function_is_the_one_called_once_without_parallel_calls(client,
                                                                          engine):
    reply = client.chat.completions.create(
        model=model_id(engine), messages=user("What should I wear in Oslo today?"),
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, temperature=0.7, seed=1, max_tokens=80)
    calls = reply.choices[0].message.tool_calls
    check_calls(calls)
    assert len(calls) == 1 and calls[0].function.name == "get_weather"


def test_a_tool_round_trip_ends_in_an_answer(client, engine):
    first = client.chat.completions.create(
        model=model_id(engine), messages=user("What is the weather in Oslo?"), tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    messages = [*user("What is the weather in Oslo?"),
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id,
                 "content": json.dumps({"city": "Oslo", "sky": "snow", "celsius": -4})}]
    final = client.chat.completions.create(model=model_id(engine), messages=messages,
                                           tools=TOOLS, tool_choice="none", temperature=0,
                                           max_tokens=40)
    choice = final.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


def test_auto_lets_the_model_answer_in_text(client, engine):
    reply = client.chat.completions.create(
        model=model_id(engine), messages=user("Say hello."), tools=TOOLS, tool_choice="auto",
        temperature=0, max_tokens=20)
    choice = reply.choices[0]
    if choice.message.tool_calls:  # a small model may call anyway: then validly
        check_calls(choice.message.tool_calls)
    else:
        assert choice.message.content


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nah"}}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_get_400_naming_the_field(client, engine, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id(engine), messages=user("hi"),
                                       max_tokens=4, **fields)
    assert caught.value.body["param"] == param, caught.value.body


def test_the_splitter_holds_back_a_marker_and_keeps_bad_calls_as_text():
    splitter = CallSplitter(CallSyntax("<tool_call>", "</tool_call>", None), [])
    shown = []
    text = ('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> and '
            '<tool_call>not json</tool_call> done<tool')
    for ch in text:  # one character at a time: markers split across deltas
        content, _ = splitter.feed(ch)
        shown.append(content)
    content, _ = splitter.feed("", final=True)
    shown.append(content)
    assert "".join(shown) == "Sure.  and <tool_call>not json</tool_call> done<tool"
    assert [c["function"] for c in splitter.calls] == [{"name": "f", "arguments": '{"a": 1}'}]
