"""Bad input to the HTTP server gets a 400 that names the field, and long text neither blocks
the event loop nor is tokenized when its length alone rules it out."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

import photon.server.openai_serving as openai_serving
from photon.errors import ParamError
from photon.server.tokenization import char_bound
from photon.tokenizer import Tokenizer
from tests.server_util import LiveServer, in_process_only, live_server

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server() as s:
        yield s


@pytest.fixture()
def tokenizer(server: LiveServer) -> Tokenizer:
    return server.engine.frontend.tokenizer


def post_raw(server: LiveServer, path: str, body: str) -> httpx.Response:
    """POST a JSON text as is: lone surrogates and Infinity, which json= would not send."""
    return httpx.post(server.base_url + path, content=body.encode("ascii"), timeout=60,
                      headers={"Content-Type": "application/json"})


def error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    return err


# ---- lone surrogates ----------------------------------------------------------------------

SURROGATE = "hi \ud800 there"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", SURROGATE]}, "prompt"),
    ("/v1/completions", {"prompt": "ok", "stop": [SURROGATE]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]},
     "messages"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
     "messages"),
    ("/v1/completions", {"prompt": "ok", "structured_outputs": {"json": {"a": SURROGATE}}},
     "structured_outputs"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
])
def test_lone_surrogate_is_400(server: LiveServer, path: str, body: dict[str, Any],
                               param: str) -> None:
    err = error(post_raw(server, path, json.dumps({"max_tokens": 2, **body})))
    assert err["param"] == param
    assert "surrogate (U+D800)" in err["message"] and "valid Unicode" in err["message"]


# ---- types JSON would let through -----------------------------------------------------------

@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": [True, False]}, "prompt", ["prompt[0] is true", "token ids"]),
    ({"prompt": [1.0, 2.0]}, "prompt", ["prompt[0] is float"]),
    ({"prompt": [[1, 2], [3, False]]}, "prompt", ["prompt[1][1] is false"]),
    ({"prompt": ["a", 1]}, "prompt", ["mixes"]),
    ({"prompt": "x", "n": True}, "n", ["got true"]),
    ({"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids", ["integer"]),
    ({"prompt": "x", "temperature": True}, "temperature", ["got true"]),
])
def test_wrong_json_types_are_400(server: LiveServer, body: dict[str, Any], param: str,
                                  words: list[str]) -> None:
    err = error(httpx.post(server.api_url + "/completions", json={"max_tokens": 2, **body}))
    assert err["param"] == param, err
    assert all(w in err["message"] for w in words), err["message"]


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e308", "-1e39"])
@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p"])
def test_non_finite_numbers_are_400(server: LiveServer, field: str, value: str) -> None:
    err = error(post_raw(server, "/v1/completions",
                         f'{{"prompt": "x", "max_tokens": 2, "{field}": {value}}}'))
    assert err["param"] == field


@pytest.mark.parametrize("role", ["wizard", "", "USER"])
def test_unknown_chat_role_is_400(server: LiveServer, role: str) -> None:
    r = httpx.post(server.api_url + "/chat/completions", timeout=60,
                   json={"messages": [{"role": role, "content": "hi"}], "max_tokens": 2})
    err = error(r)
    assert err["param"] == "messages"
    assert err["message"].startswith("messages.0.role: ") and "'assistant'" in err["message"]


# ---- SamplingParams' errors name the field --------------------------------------------------

def _raising(exc: ValueError) -> Any:
    def make(**_: Any) -> Any:
        raise exc
    return make


@pytest.mark.parametrize(("exc", "param"), [
    (ParamError("seed", "the seed must fit in 64 bits"), "seed"),
    (ValueError("top_k must be at most the vocabulary size"), "top_k"),
    (ValueError("a request-wide rule was broken"), None),
])
def test_sampling_params_errors_name_the_field(server: LiveServer, monkeypatch: Any,
                                               exc: ValueError, param: str | None) -> None:
    in_process_only()
    monkeypatch.setattr(openai_serving, "SamplingParams", _raising(exc))
    for path, body in (("/completions", {"prompt": "x"}), ("/chat/completions",
                                                            {"messages": CHAT})):
        err = error(httpx.post(server.api_url + path, json={"max_tokens": 2, **body}))
        assert (err["param"], err["message"]) == (param, str(exc))


# ---- long text --------------------------------------------------------------------------------

@pytest.fixture()
def blocked_tokenizer(tokenizer: Tokenizer, monkeypatch: Any
                      ) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Every encode waits for `release` after setting `entered`."""
    entered, release = threading.Event(), threading.Event()

    def hold(real: Any) -> Any:
        def encode(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            assert release.wait(60), "never released"
            return real(*args, **kwargs)
        return encode

    for name in ("encode", "encode_batch"):
        monkeypatch.setattr(tokenizer, name, hold(getattr(tokenizer, name)))
    try:
        yield entered, release
    finally:
        release.set()


def test_health_answers_while_tokenizing(server: LiveServer,
                                         blocked_tokenizer: tuple[threading.Event,
                                                                  threading.Event]) -> None:
    in_process_only()
    entered, release = blocked_tokenizer
    with ThreadPoolExecutor(1) as pool:
        tokenize = pool.submit(httpx.post, server.base_url + "/tokenize", timeout=60,
                               json={"prompt": "hello world " * 1000})
        assert entered.wait(30), "the tokenizer was not called"
        # The tokenizer is inside its call now; the event loop must still answer.
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        release.set()
        assert tokenize.result(60).json()["count"] >= 1000


@pytest.fixture()
def encode_calls(tokenizer: Tokenizer, monkeypatch: Any) -> list[str]:
    calls: list[str] = []

    def spy(name: str) -> Any:
        real = getattr(tokenizer, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)
        return call

    for name in ("encode", "encode_batch"):
        monkeypatch.setattr(tokenizer, name, spy(name))
    return calls


def test_too_long_text_is_refused_before_tokenizing(server: LiveServer, tokenizer: Tokenizer,
                                                    encode_calls: list[str]) -> None:
    in_process_only()
    bound = char_bound(tokenizer)
    assert bound is not None  # byte-level BPE: bounded by its longest token
    max_len = server.app.state.config.max_model_len
    text = "a" * (max_len * bound.chars_per_token + 1)
    err = error(httpx.post(server.api_url + "/completions", timeout=60,
                           json={"prompt": text, "max_tokens": 2}))
    assert err["param"] == "prompt" and f"{len(text)} characters" in err["message"]
    err = error(httpx.post(server.api_url + "/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": text}]}))
    assert err["param"] == "messages" and "characters" in err["message"]
    assert encode_calls == []
    # Under the bound the tokenizer decides, and says it in tokens.
    err = error(httpx.post(server.api_url + "/completions", timeout=60,
                           json={"prompt": "hello " * max_len, "max_tokens": 2}))
    assert "tokens long" in err["message"] and encode_calls == ["encode_batch"]
