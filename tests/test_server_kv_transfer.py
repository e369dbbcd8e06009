"""`kv_transfer_params` (vLLM's prefill/decode disaggregation field) through the OpenAI server:
the request's object reaches the engine as given, and what the engine returns on the final
output comes back in the response (and the final streamed chunk)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.kv_transfer_engine import (
    EngineWithoutConnector,
    TransferRecordingEngine,
    kv_transfer_server,
)
from tests.server_util import LiveServer

PREFILL = {"do_remote_decode": True}
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with kv_transfer_server() as live:
        yield live


def _received(server: LiveServer) -> list:
    engine = server.engine
    assert isinstance(engine, TransferRecordingEngine)
    return engine.received


def _post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.api_url + path, json=body, timeout=60)


@pytest.mark.parametrize(("path", "body"), [
    ("/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/chat/completions", {"messages": CHAT, "max_completion_tokens": 1}),
])
def test_prefill_request_returns_the_engines_params(server: LiveServer, path: str,
                                                    body: dict) -> None:
    r = _post(server, path, {**body, "kv_transfer_params": PREFILL})
    assert r.status_code == 200, r.text
    rid, given = _received(server)[-1]
    assert given == PREFILL
    assert r.json()["kv_transfer_params"] == {"do_remote_prefill": True,
                                              "remote_request_id": rid,
                                              "remote_block_ids": [1, 2]}


@pytest.mark.parametrize(("path", "body"), [
    ("/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/chat/completions", {"messages": CHAT, "max_tokens": 2}),
])
def test_decode_request_passes_params_through_and_returns_none(server: LiveServer, path: str,
                                                               body: dict) -> None:
    params = {"do_remote_prefill": True, "remote_request_id": "cmpl-x", "remote_block_ids": [3]}
    r = _post(server, path, {**body, "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    assert _received(server)[-1][1] == params
    assert "kv_transfer_params" not in r.json()


def test_without_params_the_engine_gets_none(server: LiveServer) -> None:
    r = _post(server, "/completions", {"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert _received(server)[-1][1] is None and "kv_transfer_params" not in r.json()


def _data_events(r: httpx.Response) -> list[dict]:
    lines = [ln.removeprefix("data: ") for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.parametrize(("path", "body"), [
    ("/completions", {"prompt": "hi", "max_tokens": 3}),
    ("/chat/completions", {"messages": CHAT, "max_tokens": 3}),
])
def test_final_streamed_chunk_carries_the_params(server: LiveServer, path: str,
                                                 body: dict) -> None:
    r = _post(server, path, {**body, "ignore_eos": True, "stream": True,
                             "kv_transfer_params": PREFILL})
    assert r.status_code == 200, r.text
    events = _data_events(r)
    rid = _received(server)[-1][0]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["kv_transfer_params"]["remote_request_id"] == rid
    # Chunks before the final output's (chat's role chunk, earlier tokens) carry none; a fast
    # engine may have finished before the first chunk was sent (the stream merges outputs).
    final = next(i for i, e in enumerate(events)
                 if any(c.get("finish_reason") for c in e["choices"]))
    assert all("kv_transfer_params" not in e for e in events[:final])


@pytest.mark.parametrize("body", [
    {"prompt": ["a", "b"], "max_tokens": 1},
    {"prompt": "a", "max_tokens": 1, "n": 2},
])
def test_params_with_several_sequences_are_400(server: LiveServer, body: dict) -> None:
    count = len(_received(server))
    r = _post(server, "/completions", {**body, "kv_transfer_params": PREFILL})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params" and "one prompt with n=1" in err["message"]
    assert len(_received(server)) == count  # nothing reached the engine


def test_params_must_be_an_object(server: LiveServer) -> None:
    r = _post(server, "/completions", {"prompt": "a", "max_tokens": 1, "kv_transfer_params": 3})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "kv_transfer_params"


def test_engine_without_connector_refuses_params() -> None:
    with kv_transfer_server(EngineWithoutConnector) as live:
        r = _post(live, "/completions", {"prompt": "a", "max_tokens": 1,
                                         "kv_transfer_params": PREFILL})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "kv_transfer_params" and "not supported" in err["message"]
        ok = _post(live, "/completions", {"prompt": "a", "max_tokens": 1})
        assert ok.status_code == 200, ok.text
