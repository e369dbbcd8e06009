"""Structured outputs over HTTP with the official openai client: response_format json_schema and
json_object, vLLM's structured_outputs field, and a 400 for an invalid schema or regex."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.server_util import LiveServer, live_server, openai_client

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "rank": {"type": "integer", "minimum": 1, "maximum": 10},
    "open": {"type": "boolean"}}, "required": ["city", "rank", "open"]}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server() as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai_client(server)


def test_chat_response_format_json_schema(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    resp = client.chat.completions.create(
        model="photon-tiny-random", messages=[{"role": "user", "content": "A city, please."}],
        response_format=fmt, max_tokens=150, n=3, seed=7)
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_completion_json_schema(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="photon-tiny-random", prompt="JSON:", max_tokens=150, stream=True, seed=3,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "p", "schema": SCHEMA}}})
    text, finish = "", None
    for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_structured_outputs_field(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="photon-tiny-random", prompt="Pick:", max_tokens=20, seed=1,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert resp.choices[0].text in ("red", "green", "blue")
    resp = client.completions.create(
        model="photon-tiny-random", prompt="Num:", max_tokens=20, seed=1,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{2}"}})
    assert len(resp.choices[0].text) == 6 and resp.choices[0].finish_reason == "stop"


def test_json_object(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="photon-tiny-random", messages=[{"role": "user", "content": "JSON"}],
        response_format={"type": "json_object"}, max_tokens=30)
    assert resp.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "invalid"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "invalid regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"structured_outputs": {"grammar": 'root ::= "a"' + " " * 70000}},
     r"grammar is 70,012 characters long; at most 65,536 are allowed "
     r"\(structured_outputs_max_chars\)"),
    ({"structured_outputs": {"choice": [str(i) for i in range(1025)]}},
     "choice has 1,025 entries; at most 1,024"),
])
def test_invalid_structured_outputs_is_400(client: openai.OpenAI, server: LiveServer,
                                           extra: dict, words: str) -> None:
    with pytest.raises(openai.BadRequestError, match=words):
        client.completions.create(model="photon-tiny-random", prompt="x", max_tokens=5,
                                  extra_body=extra)
    resp = client.completions.create(model="photon-tiny-random", prompt="still fine", max_tokens=3)
    assert resp.choices[0].finish_reason is not None
    assert server.engine.healthy
