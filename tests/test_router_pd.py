"""`photon router --prefill ... --decode ...`: the router as the front of prefill/decode
disaggregation, against fake instances (tests/proxy_backends.py): the prefill hop goes where the
KV events put the prompt's prefix, the decode hop gets that instance's kv_transfer_params,
streams pass through, a dead prefill instance fails over; the backends file's roles."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from photon.engine.block_hash import block_hashes as chain_block_hashes
from photon.router.backends import Listed, read_backends_file
from photon.router.router import Router, RouterConfig, RouterParts
from tests import router_util as ru
from tests.proxy_backends import SSE_CHUNKS, TRANSFER, FakeBackend, closed_port_url
from tests.server_util import serve_asgi, wait_until

pytestmark = pytest.mark.timeout(60)

PROMPT = "a system prompt that prefill-b has seen"


@dataclass
class PD:
    base: str  # the router's
    router: Router
    prefill: list[FakeBackend]
    decode: FakeBackend
    urls: list[str]  # prefill-a, prefill-b, decode

    def post(self, body: dict, path: str = "/v1/completions") -> httpx.Response:
        return httpx.post(self.base + path, json=body, timeout=30)

    def metric(self, series: str) -> float:
        for line in httpx.get(self.base + "/metrics", timeout=30).text.splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
        return 0.0


def _config(prefill: list[str], decode: list[str], **kw: object) -> RouterConfig:
    options: dict[str, object] = {"health_interval_s": 0.05, "health_timeout_s": 1.0,
                                  "connect_timeout_s": 2.0, "request_timeout_s": 30.0, **kw}
    return RouterConfig(prefill=tuple(prefill), decode=tuple(decode),
                        **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pd() -> Iterator[PD]:
    """Two prefill instances (prefill-b publishes KV events) and one decode instance behind a
    prefix_aware router."""
    pub = ru.Publisher()
    fakes = [FakeBackend("prefill-a", params={"from": "a"}),
             FakeBackend("prefill-b", params={"from": "b"}), FakeBackend("decode")]
    parts = RouterParts(tokenizer=ru.letter_tokenizer(), hasher=chain_block_hashes)
    with ExitStack() as stack:
        stack.callback(pub.sock.close, linger=0)
        urls = [stack.enter_context(serve_asgi(f.app())) for f in fakes]
        config = _config(urls[:2], urls[2:], policy="prefix_aware", block_size=4,
                         kv_events=("tcp://127.0.0.1:1", pub.endpoint))
        router, base = stack.enter_context(ru.live_router(config, parts))
        pub.until_heard(router.subscribers[urls[1]])
        tokens = [ord(c) for c in PROMPT]
        pub.publish(ru.encode([ru.stored(chain_block_hashes(tokens, 4), tokens)]))
        wait_until(lambda: router.index.num_blocks() > 0, "prefill-b's blocks are indexed")
        yield PD(base, router, fakes[:2], fakes[2], urls)


@pytest.fixture(autouse=True)
def _reset(request: pytest.FixtureRequest) -> None:
    if "pd" in request.fixturenames:
        for fake in (*request.getfixturevalue("pd").prefill, request.getfixturevalue("pd").decode):
            fake.seen.clear()
            fake.answer = None


def test_prefill_goes_where_the_prefix_is_and_decode_gets_its_params(pd: PD) -> None:
    body = {"model": "m", "prompt": PROMPT + ", and a question", "max_tokens": 20}
    for _ in range(2):
        r = pd.post(body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "decode"
    a, b = pd.prefill
    assert a.seen == [] and len(b.seen) == 2
    assert b.seen[0].body == {**body, "max_tokens": 1, "stream": False,
                              "kv_transfer_params": {"do_remote_decode": True}}
    assert [s.body for s in pd.decode.seen] == [{**body, "kv_transfer_params": {"from": "b"}}] * 2
    assert b.seen[0].headers["x-request-id"] == pd.decode.seen[0].headers["x-request-id"]
    assert pd.metric('photon_router:hop_requests_total{role="prefill"}') >= 2
    assert pd.metric("photon_router:decode_seconds_count") >= 2
    assert pd.metric('photon_router:policy_decisions_total{policy="prefix_aware",'
                     'reason="prefix"}') >= 2


def test_chat_stream_passes_through(pd: PD) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_completion_tokens": 9}
    with httpx.stream("POST", pd.base + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.read() == b"".join(SSE_CHUNKS)
    (pre,) = [s for f in pd.prefill for s in f.seen]
    assert (pre.body["stream"], pre.body["max_completion_tokens"]) == (False, 1)
    assert pd.decode.seen[0].body["stream"] is True


def test_backend_errors_reach_the_client_and_several_sequences_skip_prefill(pd: PD) -> None:
    error = b'{"error":{"message":"bad top_p","type":"invalid_request_error",' \
            b'"param":"top_p","code":null}}'
    for fake in pd.prefill:
        fake.answer = (400, error, {"content-type": "application/json"})
    r = pd.post({"prompt": "x", "top_p": 7})
    assert r.status_code == 400 and r.content == error and pd.decode.seen == []
    r = pd.post({"prompt": ["x", "y"]})
    assert r.status_code == 200 and pd.decode.seen[0].body == {"prompt": ["x", "y"]}


def test_health_names_each_role(pd: PD) -> None:
    health = httpx.get(pd.base + "/health", timeout=30).json()
    assert health["prefill"] == {pd.urls[0]: "up", pd.urls[1]: "up"}
    assert health["decode"] == {pd.urls[2]: "up"}


def test_a_dead_prefill_instance_fails_over() -> None:
    dead = closed_port_url()
    live, decode = FakeBackend("prefill-live"), FakeBackend("decode")
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_asgi(f.app())) for f in (live, decode)]
        config = _config([dead, urls[0]], [urls[1]], policy="round_robin",
                         scrape_metrics=False, health_interval_s=600.0)
        router, base = stack.enter_context(ru.live_router(config))
        wait_until(lambda: not router.pool.get(dead).healthy, "the first health check")
        router.pool.get(dead).healthy = True  # as if it had died since
        router.policy._turn = 0  # round robin: the dead one first
        r = httpx.post(base + "/v1/completions", json={"prompt": "x"}, timeout=30)
        metrics = httpx.get(base + "/metrics", timeout=30).text
        assert not router.pool.get(dead).healthy
        router.decode_pool.get(urls[1]).healthy = False
        none = httpx.post(base + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 200, r.text
    assert len(live.seen) == 1 and decode.seen[0].body["kv_transfer_params"] == TRANSFER
    assert "photon_router:retries_total 1.0" in metrics
    assert 'photon_router:hop_requests_total{role="prefill"} 2.0' in metrics
    assert 'photon_router:hop_errors_total{reason="unreachable",role="prefill"} 1.0' in metrics
    assert none.status_code == 503 and len(live.seen) == 1  # no prefill without a decoder
    assert none.json()["error"]["message"] == "no healthy decode instance to send the request to"


def test_backends_file_roles(tmp_path: Path) -> None:
    path = tmp_path / "backends.txt"
    path.write_text("# pools\nprefill http://p:1\ndecode http://d:1/  # one\nprefill p:2\n")
    with pytest.raises(ValueError, match="is not an http"):
        read_backends_file(str(path))
    path.write_text("prefill http://p:1\ndecode http://d:1/  # one\n\n")
    assert read_backends_file(str(path)) == Listed((), ("http://p:1",), ("http://d:1",))
    router = Router(RouterConfig(backends_file=str(path)))
    assert router.disaggregated and router.pool.urls() == ["http://p:1"]
    path.write_text("http://a:1\n")
    router.reload_backends()  # cannot switch to plain backends: the pools stay
    assert (router.pool.urls(), router.decode_pool.urls()) == (["http://p:1"], ["http://d:1"])
    path.write_text("prefill http://p:1\ndecode http://d:2\n")
    router.reload_backends()
    assert router.decode_pool.urls() == ["http://d:2"]
    path.write_text("http://a:1\nencode http://d:1\n")
    with pytest.raises(ValueError, match=r"backends.txt:2: 'encode http://d:1' is not a "
                                         r"backend line"):
        read_backends_file(str(path))


@pytest.mark.parametrize("listed, words", [
    (Listed(("http://a:1",), ("http://p:1",), ("http://d:1",)), "cannot be mixed"),
    (Listed((), ("http://p:1",), ()), "got 1 prefill (--prefill) and 0 decode (--decode)"),
    (Listed((), ("http://p:1",), ("http://p:1/",)), "listed twice: http://p:1"),
])
def test_listed_backends_are_checked(listed: Listed, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        listed.check()


def test_cli_pairs_kv_events_with_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    from photon.cli import main

    argv = ["router", "--prefill", "http://p:1", "--decode", "http://d:1", "--kv-events",
            "tcp://p:1", "tcp://p:2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--kv-events: give one endpoint per --prefill URL (1), got 2" in err
