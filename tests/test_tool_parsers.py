"""Tool-call parsers on canned model text: hermes, llama3_json, mistral and the forced-choice
readers. Streaming (fed char by char and token-sized) reassembles to the non-streamed result."""

from __future__ import annotations

import json
from typing import Any

import pytest

from photon.server.tool_parsers import (
    NamedCallParser,
    RequiredCallsParser,
    ToolCallStream,
    ToolParser,
    get_tool_parser,
    tool_parser_names,
)

WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"q": "a } \\" ] { [", "xs": [1, {"y": null}], "n": -2.5e3}'


def calls(parser: ToolParser, text: str, max_calls: int | None = None
          ) -> tuple[str | None, list[tuple[str, str]]]:
    found = parser.extract(text, max_calls)
    return found.content, [(c.name, c.arguments) for c in found.tool_calls]


def streamed(parser: ToolParser, pieces: list[str], max_calls: int | None = None
             ) -> tuple[str | None, list[tuple[str, str]], list[dict[str, Any]]]:
    """Feed `pieces`, then finish; the content and calls the deltas add up to, and the deltas."""
    stream = ToolCallStream(parser, max_calls)
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        news = stream.feed(piece, final=i == len(pieces) - 1)
        content += news.content
        deltas += news.tool_calls
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in deltas:
        i = d["index"]
        if "id" in d:  # the first delta of a call: id, type and name
            assert i == len(names) and d["type"] == "function" and d["id"]
            names[i] = d["function"]["name"]
            args[i] = ""
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        args[i] += d["function"]["arguments"]
    return content or None, [(names[i], args[i]) for i in sorted(names)], deltas


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] + [""]


def assert_streams_equal(parser: ToolParser, text: str, max_calls: int | None = None) -> None:
    expected = calls(parser, text, max_calls)
    for size in (1, 2, 3, 7, len(text) or 1):
        content, got, _ = streamed(parser, pieces_of(text, size), max_calls)
        assert (content, got) == expected, f"piece size {size}"


HERMES = [
    # (text, content, calls)
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    (f'Let me look.\n<tool_call>\n{{"name": "a", "arguments": {WEATHER}}}\n</tool_call>\n'
     f'<tool_call>\n{{"arguments": {NESTED}, "name": "b"}}\n</tool_call>\nDone.',
     "Let me look.\nDone.", [("a", WEATHER), ("b", NESTED)]),
    ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>', None, [("a", "{}")]),
    # unterminated at the end of the output, as vLLM reads it
    (f'<tool_call>{{"name": "a", "arguments": {WEATHER}}}', None, [("a", WEATHER)]),
    ("No tools needed: x < y and <tool is not a tag.", "No tools needed: x < y and <tool is "
     "not a tag.", []),
    # a malformed block is content, tags included; good blocks around it still count
    ('<tool_call>not json</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>',
     "<tool_call>not json</tool_call>", [("b", "{}")]),
]


@pytest.mark.parametrize("text, content, expected", HERMES)
def test_hermes(text: str, content: str | None, expected: list[tuple[str, str]]) -> None:
    parser = get_tool_parser("hermes")
    assert calls(parser, text) == (content, expected)
    for _, args in expected:
        json.loads(args)
    assert_streams_equal(parser, text)


LLAMA = [
    (f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
    (f'<|python_tag|>{{"name": "a", "parameters": {WEATHER}}}; {{"name": "b", "arguments": '
     f'{NESTED}}}', None, [("a", WEATHER), ("b", NESTED)]),
    (f' {{"name": "a", "parameters": {WEATHER}}};', None, [("a", WEATHER)]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ('{"name": "a", "parameters": {}} and then some text', None, [("a", "{}")]),
]


@pytest.mark.parametrize("text, content, expected", LLAMA)
def test_llama3_json(text: str, content: str | None, expected: list[tuple[str, str]]) -> None:
    parser = get_tool_parser("llama3_json")
    found = calls(parser, text)
    if text.endswith("some text"):  # text after the calls is content
        assert found == ("and then some text", expected)
    else:
        assert found == (content, expected)
    assert_streams_equal(parser, text)


MISTRAL = [
    (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}]', None,
     [("get_weather", WEATHER)]),
    (f'Sure.[TOOL_CALLS][{{"name": "a", "arguments": {WEATHER}}}, {{"arguments": {NESTED}, '
     f'"name": "b"}}]', "Sure.", [("a", WEATHER), ("b", NESTED)]),
    ("Just text, [TOOL no call.", "Just text, [TOOL no call.", []),
    ('Hi [TOOL_CALLS] not an array', "Hi [TOOL_CALLS] not an array", []),
]


@pytest.mark.parametrize("text, content, expected", MISTRAL)
def test_mistral(text: str, content: str | None, expected: list[tuple[str, str]]) -> None:
    parser = get_tool_parser("mistral")
    assert parser.keep_special_tokens
    assert calls(parser, text) == (content, expected)
    assert_streams_equal(parser, text)
    ids = [c.id for c in parser.extract(text).tool_calls]
    assert all(len(i) == 9 and i.isalnum() for i in ids)


# Malformed after the name: the non-streamed result is content; a stream has announced the call.
MALFORMED_AFTER_NAME = [
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>'),
    ("hermes", '<tool_call>{"name": "a", "arguments": "x"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}} trailing</tool_call>'),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}'),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": }}]'),
]


@pytest.mark.parametrize("name, text", MALFORMED_AFTER_NAME)
def test_malformed_call_is_content(name: str, text: str) -> None:
    parser = get_tool_parser(name)
    assert calls(parser, text) == (text, [])
    content, got, _ = streamed(parser, pieces_of(text, 1))
    assert content is None and [n for n, _ in got] == ["a"]


def test_stream_announces_name_first_then_arguments_incrementally() -> None:
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>'
    _, got, deltas = streamed(get_tool_parser("hermes"), pieces_of(text, 1))
    assert got == [("get_weather", WEATHER)]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len(deltas) == 1 + len(WEATHER)  # one delta per argument character


def test_stream_holds_back_a_possible_marker() -> None:
    stream = ToolCallStream(get_tool_parser("hermes"))
    assert stream.feed("Hi <tool", final=False).content == "Hi "
    assert stream.feed("box", final=False).content == "<toolbox"
    stream = ToolCallStream(get_tool_parser("mistral"))
    assert stream.feed("[TOOL_", final=False).content == ""
    assert stream.feed("", final=True).content == "[TOOL_"


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    parser = get_tool_parser("hermes")
    assert calls(parser, text, max_calls=1) == (None, [("a", "{}")])
    assert_streams_equal(parser, text, max_calls=1)


def test_forced_readers() -> None:
    named = NamedCallParser("get_weather")
    assert calls(named, WEATHER) == (None, [("get_weather", WEATHER)])
    assert_streams_equal(named, WEATHER)
    required = RequiredCallsParser()
    text = f'[{{"name": "a", "parameters": {WEATHER}}}, {{"name": "b", "parameters": {{}}}}]'
    assert calls(required, text) == (None, [("a", WEATHER), ("b", "{}")])
    assert_streams_equal(required, text)
    cut = text[:30]  # cut short by max_tokens: not a call
    assert calls(required, cut) == (cut, [])


def test_registry() -> None:
    assert tool_parser_names() == ["hermes", "llama3_json", "mistral"]
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'; available: hermes, "
                                         "llama3_json, mistral"):
        get_tool_parser("qwen")
