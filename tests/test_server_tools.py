"""Tool calling over HTTP with the official openai client, on photon-tiny-random with
a Qwen-style chat template that renders `tools`, assistant `tool_calls` and `tool` messages.

Forced choices (a named function, "required") must give arguments valid for the function's
schema whatever the weights; "auto" is driven to an exact call text with a structured-outputs
choice, so each parser reads the model's own output through the server."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from photon.cli import build_parser
from photon.engine_args import EngineArgs
from photon.model.tiny import ensure_photon_tiny_random
from photon.server.app import build_app
from photon.server.launch import server_config
from photon.server.openai_serving import ServerConfig
from tests.server_util import TINY_ARGS, LiveServer, make_engine, serve_app

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
CLOCK = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                   "maximum": 14}}, "required": ["zone"]}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} somewhere",
                                           "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "photon-tiny-random"
PARSERS = ("hermes", "llama3_json", "mistral")


def _model_dir(root: str) -> str:
    path = os.path.join(root, "tiny-tools")
    shutil.copytree(ensure_photon_tiny_random(), path)
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["chat_template"] = TOOLS_TEMPLATE
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LiveServer]]:
    """One engine; a server without auto tool choice ("off") and one per parser."""
    path = _model_dir(str(tmp_path_factory.mktemp("model")))
    config = EngineArgs(**{**TINY_ARGS, "model": path, "served_model_name": MODEL,
                           "max_model_len": 1024}
                        ).create_config()
    engine = make_engine(config)
    engine.frontend.structured.start(wait_s=120)
    base = {"served_model_name": MODEL, "max_model_len": config.model.max_model_len}
    configs = {"off": ServerConfig(**base)}
    configs.update({p: ServerConfig(**base, enable_auto_tool_choice=True, tool_call_parser=p)
                    for p in PARSERS})
    try:
        with contextlib.ExitStack() as stack:
            yield {name: stack.enter_context(serve_app(build_app(engine, cfg)))
                   for name, cfg in configs.items()}
    finally:
        engine.shutdown()


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(servers: dict[str, LiveServer]) -> openai.OpenAI:
    return _client(servers["hermes"])


def _calls(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def _stream(client: openai.OpenAI, **kwargs: Any) -> tuple[str | None, list[tuple[str, str]],
                                                            str | None]:
    """Content, calls and finish_reason that a stream's deltas add up to."""
    content, names, args, finish = "", {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            if d.id is not None:
                assert d.index not in names and d.type == "function"
                names[d.index], args[d.index] = d.function.name, ""
            args[d.index] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, [(names[i], args[i]) for i in sorted(names)], finish


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_tool_choice_gives_valid_arguments(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          tool_choice=NAMED, max_tokens=120, n=3, seed=5)
    for choice in resp.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_tool_choice_gives_valid_calls(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          tool_choice="required", max_tokens=200, n=3, seed=2)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for name, args in _calls(choice.message):
            jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_tokens=200, n=4, seed=3)
    assert [len(c.message.tool_calls) for c in resp.choices] == [1, 1, 1, 1]


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_streamed_forced_calls_reassemble(client: openai.OpenAI, tool_choice: Any) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                  max_tokens=200, temperature=0)
    resp = client.chat.completions.create(**kwargs)
    message, finish = resp.choices[0].message, resp.choices[0].finish_reason
    assert message.tool_calls
    assert _stream(client, **kwargs) == (message.content, _calls(message), finish)


CALL_ARGS = '{"city": "Paris", "unit": "celsius"}'
AUTO_TEXT = {
    "hermes": f'Checking.<tool_call>\n{{"name": "get_weather", "arguments": {CALL_ARGS}}}\n'
              f'</tool_call>',
    "llama3_json": f'{{"name": "get_weather", "parameters": {CALL_ARGS}}}',
    "mistral": f'Checking.[TOOL_CALLS][{{"name": "get_weather", "arguments": {CALL_ARGS}}}]',
}


@pytest.mark.parametrize("parser", PARSERS)
def test_auto_reads_the_models_calls(servers: dict[str, LiveServer], parser: str) -> None:
    """The output is forced to one exact text; the server's parser turns it into tool_calls."""
    client = _client(servers[parser])
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100,
                  extra_body={"structured_outputs": {"choice": [AUTO_TEXT[parser]]}})
    resp = client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    content = None if parser == "llama3_json" else "Checking."
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content, _calls(choice.message)) == (
        content, [("get_weather", CALL_ARGS)])
    assert _stream(client, **kwargs) == (content, [("get_weather", CALL_ARGS)], "tool_calls")


def test_auto_without_a_call_is_content(servers: dict[str, LiveServer]) -> None:
    client = _client(servers["hermes"])
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["It is sunny."]}})
    choice = resp.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == ("It is sunny.", None)
    assert choice.finish_reason == "stop"


def _post(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.api_url + "/chat/completions",
                      json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body},
                      timeout=60)


def test_auto_needs_the_flags(servers: dict[str, LiveServer]) -> None:
    off = servers["off"]
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        r = _post(off, body)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            'to be set')
        assert r.json()["error"]["param"] == "tool_choice"
    r = _post(off, {"tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]
    r = _post(off, {"tools": TOOLS, "tool_choice": NAMED})  # forced choices need no flag
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"]


BAD_REQUESTS = [
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "names the function 'nope', which is not in tools (given: get_weather, "
                    "get_time)"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "do not give response_format or structured_outputs"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
      "tool_choice": "required"}, "tools", ""),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages", "messages[0].tool_calls[0].function.arguments is not valid JSON"),
]


@pytest.mark.parametrize("body, param, words", BAD_REQUESTS)
def test_bad_tool_requests(servers: dict[str, LiveServer], body: dict[str, Any], param: str,
                           words: str) -> None:
    r = _post(servers["hermes"], body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function",
         "function": {"name": "get_weather", "arguments": CALL_ARGS}}]},
    {"role": "tool", "tool_call_id": "call_7", "content": "12 degrees"},
]


def test_tools_and_tool_messages_reach_the_template(servers: dict[str, LiveServer]) -> None:
    server = servers["hermes"]
    r = httpx.post(server.base_url + "/tokenize",
                   json={"messages": CONVERSATION, "tools": TOOLS}, timeout=60)
    assert r.status_code == 200, r.text
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": r.json()["tokens"]},
                      timeout=60).json()["prompt"]
    assert json.dumps(TOOLS[1]) in text  # the tools, as the template renders them
    assert f'{{"name": "get_weather", "arguments": {CALL_ARGS}}}' in text  # arguments: object
    assert "<tool_response>\n12 degrees\n</tool_response>" in text
    resp = _client(server).chat.completions.create(
        model=MODEL, messages=CONVERSATION, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert resp.choices[0].message.tool_calls is None


def test_serve_tool_flags() -> None:
    parse = build_parser().parse_args
    config = server_config(parse(["serve", "--enable-auto-tool-choice", "--tool-call-parser",
                                  "hermes"]), "m", 64)
    assert (config.enable_auto_tool_choice, config.tool_call_parser) == (True, "hermes")
    with pytest.raises(ValueError, match=r"--enable-auto-tool-choice needs --tool-call-parser "
                                         r"\(one of: hermes, llama3_json, mistral\)"):
        server_config(parse(["serve", "--enable-auto-tool-choice"]), "m", 64)
    with pytest.raises(ValueError, match="--tool-call-parser: unknown tool call parser 'qwen'; "
                                         "available: hermes, llama3_json, mistral"):
        server_config(parse(["serve", "--tool-call-parser", "qwen"]), "m", 64)
