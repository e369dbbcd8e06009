"""The OpenAI-compatible server against the official `openai` client (live uvicorn, loopback)."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server_util import (
    LiveServer,
    api_server_count,
    engine_mode,
    live_server,
    wait_drained,
    wait_until,
)

KEY = "test-key"
MODEL = "photon-tiny-random"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(api_key=KEY, max_request_body_bytes=1 << 20) as s:
        yield s


@pytest.fixture(scope="module")
def two_servers() -> Iterator[LiveServer]:
    """The same server as `photon serve --api-server-count 2` runs it."""
    with live_server(api_servers=2, api_key=KEY, max_request_body_bytes=1 << 20) as s:
        yield s


@pytest.fixture(params=["default", "api-servers-2"])
def any_server(request: pytest.FixtureRequest, server: LiveServer) -> LiveServer:
    """A few representative tests run against both: one and two API server processes."""
    return server if request.param == "default" else request.getfixturevalue("two_servers")


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=KEY, max_retries=0, timeout=60)


def metric(server: LiveServer, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in '{ ,':
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def num_running(server: LiveServer) -> int:
    return server.engine.call_utility("num_running")


def test_models_and_health(client: openai.OpenAI, server: LiveServer) -> None:
    models = client.models.list()
    assert [m.id for m in models] == [MODEL]
    # `root` is the served name: the server's filesystem layout is not the client's business.
    assert [m.model_extra["root"] for m in models] == [MODEL]
    model_dir = server.engine.frontend.config.model.model
    assert model_dir not in models.model_dump_json()
    assert httpx.get(server.base_url + "/health").status_code == 200  # no key needed


def test_version_and_ping(server: LiveServer) -> None:
    """vLLM's /version, and /ping (SageMaker's health check) for GET and POST; no key needed."""
    import photon

    r = httpx.get(server.base_url + "/version")
    assert r.status_code == 200 and r.json() == {"version": photon.__version__}
    for method in ("GET", "POST"):
        r = httpx.request(method, server.base_url + "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    ids = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=3, n=2,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in ids.choices) == [0, 1, 2, 3]
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 12


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs) and lp.text_offset[0] == 0


def test_chat_n_and_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4,
        n=3, logprobs=True, top_logprobs=2, seed=7, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and len(r.choices) == 3
    for c in r.choices:
        assert c.message.role == "assistant" and len(c.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert r.usage.completion_tokens == 12


def test_chat_stream_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    full = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, seed=3,
        extra_body={"ignore_eos": True})
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, seed=3,
        stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in again if c.choices)
    assert text == full.choices[0].message.content


def test_completion_stream_usage(any_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=any_server.api_url, api_key=KEY, max_retries=0, timeout=60)
    chunks = list(client.completions.create(
        model=MODEL, prompt="abc", max_tokens=5, stream=True, n=2,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []
    assert {c.choices[0].index for c in chunks[:-1]} == {0, 1}


def test_auth(server: LiveServer) -> None:
    bad = openai.OpenAI(base_url=server.api_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(server.api_url + "/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/metrics").status_code == 200


@pytest.mark.parametrize("kwargs, words", [
    ({"temperature": -1}, ["temperature"]),
    ({"top_p": 2}, ["top_p"]),
    ({"max_tokens": 300}, ["256", "300"]),
    ({"prompt": [5, 99999]}, ["99999", "vocabulary"]),
    ({"extra_body": {"stop_token_ids": [99999]}}, ["stop_token_ids"]),
    ({"n": "many"}, ["n"]),
    ({"prompt": ""}, ["empty"]),
])
def test_bad_requests(client: openai.OpenAI, kwargs: dict, words: list[str]) -> None:
    args = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    message = e.value.body["message"]
    assert all(w in message for w in words), message


def test_bad_json_and_body_limit(any_server: LiveServer) -> None:
    server = any_server
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(server.api_url + "/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.api_url + "/completions", content=b"x" * (2 << 20), headers=h)
    assert r.status_code == 413


def test_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_tokenize_roundtrip(server: LiveServer) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    toks = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello world"}, headers=h)
    ids = toks.json()["tokens"]
    assert toks.json()["count"] == len(ids) > 0
    back = httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, headers=h)
    assert back.json()["prompt"] == "Hello world"
    for tokens in ([-1], [5, 99999]):
        bad = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens}, headers=h)
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "tokens", bad.json()
        assert str(tokens[-1]) in bad.json()["error"]["message"]


def test_disconnect_mid_stream_frees_blocks(any_server: LiveServer) -> None:
    server = any_server
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "tell me a story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.api_url + "/completions", json=body, headers=h) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert num_running(server) == 1
    wait_drained(server.engine)
    assert metric(server, 'photon:request_success_total{finished_reason="abort"') >= 1


def test_disconnect_non_streaming(server: LiveServer) -> None:
    """A client that hangs up on a non-streaming request aborts it: sent over a raw socket,
    closed once the engine runs the request."""
    aborted = 'photon:request_success_total{finished_reason="abort"'
    before = metric(server, aborted)
    body = json.dumps({"prompt": "story", "max_tokens": 200, "ignore_eos": True}).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: num_running(server) == 1, "the request runs")
    wait_drained(server.engine)
    assert metric(server, aborted) == before + 1


def _break_engine(s: LiveServer) -> None:
    """Kill the engine-core process (in-thread engine: its next step raises)."""
    if engine_mode() == "thread":
        def boom() -> list:
            raise RuntimeError("injected failure")

        s.engine.engine.step = boom  # type: ignore[method-assign]
        return
    os.kill(s.engine.client.proc.pid, signal.SIGKILL)
    wait_until(lambda: not s.engine.healthy, "the front end notices the dead core")


def test_engine_death_gives_503_health() -> None:
    """Once the engine has stopped, /health and /ping are 503 and a new request is refused with
    503 (service_unavailable, code engine_dead), naming the cause."""
    if api_server_count() > 1:
        pytest.skip("several API servers exit once the core has died (test_serve_lifecycle's "
                    "test_core_killed_mid_stream checks them)")
    thread = engine_mode() == "thread"
    cause = "injected failure" if thread else "killed by SIGKILL"
    with live_server() as s:
        _break_engine(s)
        if thread:  # the request that runs into the failing step gets a 500 naming it
            r = httpx.post(s.api_url + "/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
            assert cause in r.json()["error"]["message"]
        assert httpx.get(s.base_url + "/health").status_code == 503
        assert httpx.get(s.base_url + "/ping").status_code == 503
        assert httpx.post(s.base_url + "/ping").status_code == 503
        for stream in (False, True):
            r = httpx.post(s.api_url + "/completions",
                           json={"prompt": "x", "max_tokens": 2, "stream": stream})
            error = r.json()["error"]
            assert r.status_code == 503, r.text
            assert (error["type"], error["code"]) == ("service_unavailable", "engine_dead")
            assert cause in error["message"], error
