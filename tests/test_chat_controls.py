"""Chat controls and reasoning output end to end: a tiny model whose tokenizer has <think> and
</think> and whose Qwen3-style template honours enable_thinking, served with --reasoning-parser
qwen3; --chat-template, chat_template_kwargs, continue_final_message; LLM.chat; structured outputs
that start after the reasoning (the grammar gate)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from photon import LLM, SamplingParams
from photon.cli import build_parser
from photon.reasoning import get_reasoning_parser
from photon.server.launch import server_config
from photon.structured.params import StructuredOutputsParams
from tests.server_util import LiveServer, live_server

THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
USER = [{"role": "user", "content": "Why is the sky blue?"}]
NO_THINK = {"enable_thinking": False}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def make_think_model(path: str) -> str:
    """photon-tiny's weights with <think> / </think> added as (non-special) tokens, as Qwen3's."""
    from tokenizers import AddedToken, Tokenizer

    from photon.model.tiny import ensure_photon_tiny_random

    tiny = ensure_photon_tiny_random()
    os.makedirs(path, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny, name), os.path.join(path, name))
    tok = Tokenizer.from_file(os.path.join(tiny, "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.save(os.path.join(path, "tokenizer.json"))
    config = json.loads(Path(tiny, "tokenizer_config.json").read_text())
    Path(path, "tokenizer_config.json").write_text(json.dumps({**config,
                                                               "chat_template": THINK_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_think_model(str(tmp_path_factory.mktemp("think") / "model"))


@pytest.fixture(scope="module")
def server(think_dir: str) -> Iterator[LiveServer]:
    args = {"model": think_dir, "reasoning_parser": "qwen3", "structured_outputs_worker": "inline"}
    with live_server(args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=60)


def tokenize(server: LiveServer, **body: object) -> dict:
    r = httpx.post(server.base_url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def chat(client: openai.OpenAI, regex: str, **kw: object):  # noqa: ANN201
    """A greedy chat whose output the regex forces (the prompt closed the think block, so the
    grammar applies from the first token)."""
    extra = {"chat_template_kwargs": NO_THINK, "structured_outputs": {"regex": regex},
             **kw.pop("extra_body", {})}
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=USER,
                                          temperature=0, extra_body=extra, **kw)


def test_reasoning_content_and_stream(client: openai.OpenAI) -> None:
    regex = r"<think>[a-z]{3,6}</think>[a-z]{2,5}"
    r = chat(client, regex, max_tokens=40)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"]
    reasoning = msg.model_extra["reasoning_content"]
    assert 3 <= len(reasoning) <= 6 and reasoning.isalpha()
    assert 2 <= len(msg.content) <= 5 and msg.content.isalpha()
    chunks = list(chat(client, regex, max_tokens=40, stream=True))
    kinds, streamed = [], {"reasoning_content": "", "content": ""}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        pieces = {"reasoning_content": (delta.model_extra or {}).get("reasoning_content"),
                  "content": delta.content}
        for key, piece in pieces.items():
            if piece:
                kinds.append(key)
                streamed[key] += piece
    assert streamed == {"reasoning_content": reasoning, "content": msg.content}
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning_content")


def test_unterminated_think_block_is_reasoning(client: openai.OpenAI) -> None:
    r = chat(client, r"<think>[a-z]{30}</think>x", max_tokens=6)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert msg.content is None and msg.model_extra["reasoning_content"].isalpha()


def test_no_think_block_is_all_content(client: openai.OpenAI) -> None:
    r = chat(client, r"[a-z]{4}", max_tokens=10)
    msg = r.choices[0].message
    assert len(msg.content) == 4 and msg.model_extra.get("reasoning_content") is None


def test_chat_template_kwargs_change_the_prompt(server: LiveServer, client: openai.OpenAI) -> None:
    thinking = tokenize(server, messages=USER)
    plain = tokenize(server, messages=USER, chat_template_kwargs=NO_THINK)
    think, end = (server.engine.frontend.tokenizer.token_to_id(t) for t in ("<think>", "</think>"))
    assert plain["tokens"][:thinking["count"]] == thinking["tokens"]
    assert think in plain["tokens"] and end in plain["tokens"] and think not in thinking["tokens"]
    r = chat(client, r"[a-z]{2}", max_tokens=4)  # (with NO_THINK)
    assert r.usage.prompt_tokens == plain["count"]


def test_continue_final_message(server: LiveServer) -> None:
    convo = [*USER, {"role": "assistant", "content": "Because of"}]
    cont = tokenize(server, messages=convo, add_generation_prompt=False,
                    continue_final_message=True)
    text = server.engine.frontend.tokenizer.decode(cont["tokens"], skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nBecause of")
    closed = tokenize(server, messages=convo, add_generation_prompt=False)
    assert closed["count"] > cont["count"]  # the message's end (<|im_end|>) is not rendered
    r = httpx.post(server.api_url + "/chat/completions", timeout=30, json={
        "messages": convo, "continue_final_message": True, "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "continue_final_message"
    assert "add_generation_prompt" in r.json()["error"]["message"]
    r = httpx.post(server.api_url + "/chat/completions", timeout=30, json={
        "messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_json_after_a_reasoning_prefix(client: openai.OpenAI) -> None:
    """The assistant's think block was given (continued): the reasoning ended in the prompt, so
    the schema constrains the output from its first token."""
    convo = [*USER, {"role": "assistant", "content": "<think>\nshort\n</think>\n\n"}]
    r = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=convo, temperature=0,
        max_tokens=30, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": SCHEMA}},
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_chat_template_flag(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(THINK_TEMPLATE)
    for value in (str(path), THINK_TEMPLATE):
        ns = build_parser().parse_args(["serve", "--chat-template", value])
        assert server_config(ns, "m", 64).chat_template == THINK_TEMPLATE
    for value, error in ((str(tmp_path / "missing.jinja"), "looks like a file path"),
                         ("{% if %}", "does not parse")):
        ns = build_parser().parse_args(["serve", "--chat-template", value])
        with pytest.raises(ValueError, match=error):
            server_config(ns, "m", 64)


def test_chat_template_served() -> None:
    """--chat-template replaces the model's template for chat and /tokenize."""
    with live_server(chat_template="{{ messages[0]['content'] }}|{{ extra }}") as s:
        got = tokenize(s, messages=USER, chat_template_kwargs={"extra": "E"})
        text = s.engine.frontend.tokenizer.decode(got["tokens"])
        assert text == "Why is the sky blue?|E"


def test_llm_chat_equals_generate_on_the_rendered_prompt(think_dir: str) -> None:
    llm = LLM(think_dir, max_model_len=128, structured_outputs_worker="inline")
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    convos = [USER, [{"role": "user", "content": "Hi"}]]
    got = llm.chat(convos, params, use_tqdm=False, chat_template_kwargs=NO_THINK)
    prompts = [tok.encode(tok.apply_chat_template(c, enable_thinking=False),
                          add_special_tokens=False) for c in convos]
    want = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == prompts
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    (one,) = llm.chat(USER, params, use_tqdm=False, chat_template="{{ messages[0]['content'] }}")
    assert one.prompt_token_ids == tok.encode("Why is the sky blue?", add_special_tokens=False)
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(USER, params, continue_final_message=True)
    with pytest.raises(ValueError, match="list of message dicts"):
        llm.chat(["hello"], params)


@pytest.mark.parametrize("pipelined", [False, True])
def test_grammar_starts_after_the_reasoning_end_token(pipelined: bool) -> None:
    """Until the end-of-reasoning token is committed the output is the unconstrained one
    (masks allow all); after it the schema holds. The end token is one the random model
    greedily produces, so the gate really opens mid-output."""
    llm = LLM("photon-tiny-random", max_model_len=160, pipelined=pipelined, structured_outputs_worker="inline")
    prompt = [5, 17, 230, 41, 9]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    end = free[3]
    k = free.index(end)

    class Tags:
        def token_to_id(self, token: str) -> int | None:
            return {"<think>": 2, "</think>": end}[token]

    llm.engine.reasoning = get_reasoning_parser("deepseek_r1")(Tags())
    params = SamplingParams(temperature=0, max_tokens=k + 40,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:k + 1] == free[:k + 1]
    assert out.finish_reason == "stop"
    tail = llm.get_tokenizer().decode(out.token_ids[k + 1:])
    jsonschema.validate(json.loads(tail), SCHEMA)
    # a prompt that already ended the reasoning: the schema holds from the first token
    out = llm.generate([*prompt, end], params, use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(llm.get_tokenizer().decode(out.token_ids)), SCHEMA)
