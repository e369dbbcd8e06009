"""`photon proxy`: the two-hop prefill/decode protocol against fake backends on loopback ports
(tests/proxy_backends.py), streaming passthrough, error mapping, down backends, /health,
/metrics, and end to end in front of two photon servers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import httpx
import pytest

from photon.cli import main
from photon.proxy.app import build_proxy_app
from photon.proxy.config import ProxyConfig
from photon.proxy.pool import Pool
from tests.proxy_backends import SSE_CHUNKS, TRANSFER, FakeBackend, closed_port_url
from tests.server_util import serve_asgi

CHAT = [{"role": "user", "content": "hi"}]


@dataclass
class Deployment:
    url: str  # the proxy's
    prefill: FakeBackend
    decode: FakeBackend
    prefill_url: str
    decode_url: str

    def post(self, path: str, body: dict, **kwargs: object) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=30, **kwargs)


@contextmanager
def deployment(prefill_extra: tuple[str, ...] = (), decode_extra: tuple[str, ...] = (),
               **config: float) -> Iterator[Deployment]:
    prefill, decode = FakeBackend("prefill"), FakeBackend("decode")
    with ExitStack() as stack:
        p_url = stack.enter_context(serve_asgi(prefill.app()))
        d_url = stack.enter_context(serve_asgi(decode.app()))
        cfg = ProxyConfig(prefill=(*prefill_extra, p_url), decode=(*decode_extra, d_url),
                          **config)
        url = stack.enter_context(serve_asgi(build_proxy_app(cfg)))
        yield Deployment(url, prefill, decode, p_url, d_url)


@pytest.fixture(scope="module")
def dep() -> Iterator[Deployment]:
    with deployment() as d:
        yield d


@pytest.fixture(autouse=True)
def _reset(request: pytest.FixtureRequest) -> None:
    if "dep" in request.fixturenames:
        d = request.getfixturevalue("dep")
        for b in (d.prefill, d.decode):
            b.seen.clear()
            b.answer, b.break_stream, b.healthy = None, False, True


def test_completion_goes_prefill_then_decode_with_the_returned_params(dep: Deployment) -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 50, "min_tokens": 5,
            "kv_transfer_params": {"client": "ignored"}}
    r = dep.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "decode"
    (pre,), (dec,) = dep.prefill.seen, dep.decode.seen
    assert pre.path == dec.path == "/v1/completions"
    assert pre.body == {"model": "m", "prompt": "hello", "max_tokens": 1, "stream": False,
                        "kv_transfer_params": {"do_remote_decode": True}}
    assert dec.body == {**body, "kv_transfer_params": TRANSFER}
    assert pre.headers["x-request-id"] == dec.headers["x-request-id"]


def test_chat_prefill_gets_one_completion_token(dep: Deployment) -> None:
    body = {"messages": CHAT, "max_completion_tokens": 30, "stream": True,
            "stream_options": {"include_usage": True}}
    r = dep.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    pre, dec = dep.prefill.seen[0].body, dep.decode.seen[0].body
    assert (pre["max_tokens"], pre["max_completion_tokens"], pre["stream"]) == (1, 1, False)
    assert "stream_options" not in pre and pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert dec == {**body, "kv_transfer_params": TRANSFER}


def test_stream_passes_through_unchanged(dep: Deployment) -> None:
    with httpx.stream("POST", dep.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.read() == b"".join(SSE_CHUNKS)


def test_broken_stream_ends_with_an_error_event(dep: Deployment) -> None:
    dep.decode.break_stream = True
    r = dep.post("/v1/completions", {"prompt": "x", "stream": True})
    assert r.status_code == 200
    assert r.text.startswith(SSE_CHUNKS[0].decode())
    events = [e for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"code":"bad_gateway"' in events[-2] and dep.decode_url in events[-2]


@pytest.mark.parametrize("body", [{"prompt": ["a", "b"]}, {"prompt": [[1, 2], [3]]},
                                  {"prompt": "a", "n": 2}])
def test_several_sequences_go_to_decode_whole(dep: Deployment, body: dict) -> None:
    r = dep.post("/v1/completions", {**body, "kv_transfer_params": {"x": 1}})
    assert r.status_code == 200, r.text
    assert dep.prefill.seen == [] and dep.decode.seen[0].body == body


def test_token_id_prompt_is_one_sequence(dep: Deployment) -> None:
    assert dep.post("/v1/completions", {"prompt": [1, 2, 3]}).status_code == 200
    assert len(dep.prefill.seen) == 1


def test_authorization_reaches_both_hops(dep: Deployment) -> None:
    r = dep.post("/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 200
    assert dep.prefill.seen[0].headers["authorization"] == "Bearer k"
    assert dep.decode.seen[0].headers["authorization"] == "Bearer k"


def test_models_come_from_decode(dep: Deployment) -> None:
    r = httpx.get(dep.url + "/v1/models", headers={"Authorization": "Bearer k"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "decode"
    assert dep.decode.seen[0].headers["authorization"] == "Bearer k"


def test_prefill_error_is_the_clients_and_decode_is_not_called(dep: Deployment) -> None:
    error = b'{"error":{"message":"bad top_p","type":"invalid_request_error",' \
            b'"param":"top_p","code":null}}'
    dep.prefill.answer = (400, error, {"content-type": "application/json"})
    r = dep.post("/v1/completions", {"prompt": "x", "top_p": 7})
    assert r.status_code == 400 and r.content == error
    assert dep.decode.seen == []


def test_decode_429_keeps_retry_after(dep: Deployment) -> None:
    error = b'{"error":{"message":"busy","type":"rate_limit_error","param":null,"code":null}}'
    dep.decode.answer = (429, error, {"retry-after": "3"})
    r = dep.post("/v1/chat/completions", {"messages": CHAT})
    assert r.status_code == 429 and r.json()["error"]["message"] == "busy"
    assert r.headers["retry-after"] == "3"


def test_non_json_error_becomes_an_openai_error(dep: Deployment) -> None:
    dep.decode.answer = (500, b"oops", {})
    r = dep.post("/v1/completions", {"prompt": "x"})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "backend_error" and "oops" in err["message"]
    assert dep.decode_url in err["message"]


@pytest.mark.parametrize(("content", "what"), [
    (b"not json", "other than a JSON object"),
    (b'{"kv_transfer_params": [1]}', "not a JSON object"),
])
def test_malformed_prefill_answer_is_502(dep: Deployment, content: bytes, what: str) -> None:
    dep.prefill.answer = (200, content, {})
    r = dep.post("/v1/completions", {"prompt": "x"})
    assert r.status_code == 502, r.text
    assert what in r.json()["error"]["message"] and dep.decode.seen == []


def test_prefill_without_params_decodes_the_whole_prompt(dep: Deployment) -> None:
    dep.prefill.answer = (200, b'{"id": "p"}', {})
    r = dep.post("/v1/completions", {"prompt": "x", "kv_transfer_params": {"x": 1}})
    assert r.status_code == 200
    assert dep.decode.seen[0].body == {"prompt": "x"}


@pytest.mark.parametrize(("body", "message"), [(b"{", "not valid JSON"),
                                               (b"[1]", "must be a JSON object")])
def test_bad_body_is_400(dep: Deployment, body: bytes, message: str) -> None:
    r = httpx.post(dep.url + "/v1/completions", content=body, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_health_names_what_is_down(dep: Deployment) -> None:
    r = httpx.get(dep.url + "/health", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok", "prefill": {dep.prefill_url: "ok"},
                        "decode": {dep.decode_url: "ok"}}
    dep.decode.healthy = False
    r = httpx.get(dep.url + "/health", timeout=30)
    assert r.status_code == 503
    assert r.json()["decode"] == {dep.decode_url: "answered 503"}
    message = r.json()["error"]["message"]
    assert "decode" in message and dep.decode_url in message and "prefill" not in message


def _metric(dep: Deployment, series: str) -> float:
    for line in httpx.get(dep.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_count_requests_errors_and_hops(dep: Deployment) -> None:
    names = ('photon:proxy_requests_total{endpoint="/v1/completions"}',
             'photon:proxy_backend_errors_total{pool="decode",reason="status"}',
             "photon:proxy_prefill_seconds_count", "photon:proxy_decode_seconds_count")
    before = [_metric(dep, n) for n in names]
    dep.post("/v1/completions", {"prompt": "x"})
    dep.decode.answer = (500, b"oops", {})
    dep.post("/v1/completions", {"prompt": "x"})
    after = [_metric(dep, n) for n in names]
    assert [a - b for a, b in zip(after, before)] == [2, 1, 2, 1]


def test_down_backend_is_503_and_a_reachable_one_is_used() -> None:
    down = closed_port_url()
    with deployment(prefill_extra=(down,), decode_extra=(down,)) as d:
        for _ in range(2):  # each turn, whichever instance is tried first
            assert d.post("/v1/completions", {"prompt": "x"}).status_code == 200
        assert len(d.prefill.seen) == 2 and len(d.decode.seen) == 2
    with ExitStack() as stack:
        decode = FakeBackend("decode")
        d_url = stack.enter_context(serve_asgi(decode.app()))
        cfg = ProxyConfig(prefill=(down,), decode=(d_url,))
        url = stack.enter_context(serve_asgi(build_proxy_app(cfg)))
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "backend_unavailable" and down in err["message"]
        assert decode.seen == []
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and down in health.json()["error"]["message"]


def test_silent_backend_is_504() -> None:
    with deployment(timeout_s=0.2) as d:
        gate = asyncio.Event()
        d.decode.hang = gate
        try:
            r = d.post("/v1/completions", {"prompt": "x"})
        finally:
            d.decode.hang = None
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "backend_timeout"


def test_pool_picks_least_outstanding_then_in_turn() -> None:
    pool = Pool("decode", ("a", "b", "c"))
    assert [pool.order()[0].url for _ in range(4)] == ["a", "b", "c", "a"]
    pool.backends[2].outstanding = 0
    pool.backends[0].outstanding = pool.backends[1].outstanding = 1
    assert [b.url for b in pool.order()] == ["c", "b", "a"]  # its turn: b, then c, a


@pytest.mark.parametrize(("args", "message"), [
    (["--prefill", "ftp://h:1", "--decode", "h:2"], "is not a server's base URL"),
    (["--prefill", "h:1", "--decode", "h:2", "--timeout", "0"], "--timeout must be"),
    (["--prefill", "h:1"], "--decode"),
])
def test_cli_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(["proxy", *args])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err


def test_config_normalizes_urls() -> None:
    cfg = ProxyConfig(prefill=("localhost:8100/",), decode=("https://d:1",))
    assert cfg.prefill == ("http://localhost:8100",) and cfg.decode == ("https://d:1",)


def test_end_to_end_in_front_of_two_photon_servers() -> None:
    """Through the openai client: the decode server gets exactly the params the prefill
    server returned, and the text is the one server's."""
    import openai

    from tests.kv_transfer_engine import kv_transfer_server

    with kv_transfer_server() as pre, kv_transfer_server() as dec:
        cfg = ProxyConfig(prefill=(pre.base_url,), decode=(dec.base_url,))
        with serve_asgi(build_proxy_app(cfg)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0,
                                   timeout=60)
            args = {"model": "photon-tiny-random", "prompt": "The fox", "max_tokens": 8,
                    "temperature": 0}
            text = client.completions.create(**args).choices[0].text
            streamed = "".join(c.choices[0].text for c in
                               client.completions.create(**args, stream=True) if c.choices)
        direct = httpx.post(dec.api_url + "/completions", json=args, timeout=60).json()
    assert text == streamed == direct["choices"][0]["text"]
    prefill_ids = [rid for rid, params in pre.engine.received]
    sent = [params for _, params in dec.engine.received]
    assert [p["remote_request_id"] for p in sent[:2]] == prefill_ids
    assert all(params == {"do_remote_decode": True} for _, params in pre.engine.received)
    assert sent[2] is None  # the direct request
