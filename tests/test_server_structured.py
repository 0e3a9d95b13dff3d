# ruff: noqa: F811  (test functions take the imported fixtures by name)
"""Structured output through ``pagedchat serve`` with the official ``openai`` client:
``response_format`` json_schema (strict) and json_object, streamed and not.

Reference: ``jsonschema`` validates every reply against the schema it was asked for (20
random nested schemas from tests/test_constraints.py, sent at once so they share the batch).
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.test_constrained_engine import CAT
from tests.test_constraints import random_schema

# The server fixtures of tests/test_server.py (one engine and server for these tests too).
from tests.test_server import client, engine, model_id, server, user  # noqa: F401

pytestmark = pytest.mark.model


def schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


def test_a_json_schema_reply_validates_streamed_and_not(client, engine):
    ask = user("Describe a cat as JSON: its name, age, colour and toys.")
    reply = client.chat.completions.create(
        model=model_id(engine), messages=ask, temperature=0, max_tokens=150,
        response_format=schema_format(CAT, "cat"))
    content = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(content), CAT)
    chunks = client.chat.completions.create(
        model=model_id(engine), messages=ask, temperature=0, max_tokens=150, stream=True,
        response_format=schema_format(CAT, "cat"))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == content


def test_twenty_random_schemas_each_get_a_reply_that_validates(client, engine):
    schemas = []
    for seed in range(20):
        schema = random_schema(random.Random(seed))
        if schema.get("type") != "object":
            schema = {"type": "object", "properties": {"value": schema},
                      "required": ["value"], "additionalProperties": False}
        schemas.append(schema)

    def ask(schema: dict) -> str:
        reply = client.chat.completions.create(
            model=model_id(engine), messages=user("Fill in this JSON form with an example."),
            temperature=0.8, seed=3, max_tokens=300, response_format=schema_format(schema))
        assert reply.choices[0].finish_reason == "stop", reply
        return reply.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, schemas))
    for schema, content in zip(schemas, replies):
        jsonschema.validate(json.loads(content), schema)


def test_json_object_replies_are_objects(client, engine):
    reply = client.chat.completions.create(
        model=model_id(engine), messages=user("Give me a JSON object about Paris."),
        temperature=0, max_tokens=200, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize(("response_format", "param"), [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
     "response_format.json_schema.schema"),
    (schema_format({"type": "object", "properties": {"a": {"type": "nope"}}}),
     "response_format"),
])
def test_a_bad_response_format_gets_400_naming_it(client, engine, response_format,
                                                  param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id(engine), messages=user("hi"),
                                       response_format=response_format)
    assert caught.value.body["param"] == param, caught.value.body
