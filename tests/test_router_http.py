"""`photon router`'s HTTP layer against fake backends: prefix routing fed by KV events,
streaming passthrough, retries, a killed backend, health, reloads, the CLI's errors."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from photon.engine.block_hash import block_hashes as chain_block_hashes
from photon.router.router import RouterConfig, RouterParts
from tests import router_util as ru
from tests.server_util import serve_app, wait_until

pytestmark = pytest.mark.timeout(120)


# ---- HTTP layer -----------------------------------------------------------------------------
def _config(urls: list[str], policy: str = "round_robin", **kw: object) -> RouterConfig:
    return RouterConfig(backends=tuple(urls), policy=policy, health_interval_s=0.05,
                        health_timeout_s=1.0, connect_timeout_s=2.0, request_timeout_s=30.0,
                        **kw)  # type: ignore[arg-type]


def _post(base: str, body: dict, path: str = "/v1/completions", **kw: object) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=30, **kw)  # type: ignore[arg-type]


def test_prefix_aware_sends_the_request_where_its_prefix_is() -> None:
    with ru.fake_backends("A", "B") as backends:
        urls = [s.base_url for _, s in backends]
        parts = RouterParts(tokenizer=ru.letter_tokenizer(), hasher=chain_block_hashes)
        with ru.live_router(_config(urls, "prefix_aware", block_size=4), parts) as (router, base):
            prompt = "shared system prompt, then a question"
            router.index.store(urls[1], chain_block_hashes([ord(c) for c in prompt], 4)[:5])
            for _ in range(3):
                assert _post(base, {"prompt": prompt}).json()["backend"] == "B"
            metrics = httpx.get(base + "/metrics").text
    assert 'photon_router:policy_decisions_total{policy="prefix_aware",reason="prefix"} 3.0' \
        in metrics
    # 5 stored blocks for the first request; it left all 9 pending on B for the next two.
    assert "photon_router:hit_blocks_total 23.0" in metrics
    assert "photon_router:prompt_blocks_total 27.0" in metrics  # 37 characters: 9 blocks


def test_prefix_index_is_fed_by_the_backends_kv_events() -> None:
    pub = ru.Publisher()
    tokens = [ord(c) for c in "a prompt that B has seen"]
    hashes = chain_block_hashes(tokens, 4)
    with ru.fake_backends("A", "B") as backends:
        urls = [s.base_url for _, s in backends]
        parts = RouterParts(tokenizer=ru.letter_tokenizer(), hasher=chain_block_hashes)
        config = _config(urls, "prefix_aware", block_size=4,
                         kv_events=("tcp://127.0.0.1:1", pub.endpoint))
        try:
            with ru.live_router(config, parts) as (router, base):
                pub.until_heard(router.subscribers[urls[1]])
                pub.publish(ru.encode([ru.stored(hashes, tokens)]))
                wait_until(lambda: router.index.blocks_of(urls[1]) == set(hashes), "indexed")
                picks = {_post(base, {"prompt": "a prompt that B has seen, and more"}
                               ).json()["backend"] for _ in range(3)}
                pub.publish(ru.encode([ru.AllBlocksCleared()]))
                wait_until(lambda: router.index.num_blocks() == 0, "cleared")
                mismatches = router.subscribers[urls[1]].stats.hash_mismatches
            assert not router.subscribers  # stopped with the router
        finally:
            pub.sock.close(linger=0)
    assert picks == {"B"} and mismatches == 0


def test_streaming_passes_through_and_auth_reaches_the_backend() -> None:
    with ru.fake_backends("A") as backends:
        with ru.live_router(_config([backends[0][1].base_url])) as (_, base):
            with httpx.stream("POST", base + "/v1/chat/completions", timeout=30,
                              json={"messages": [], "stream": True}) as resp:
                assert resp.headers["content-type"].startswith("text/event-stream")
                body = b"".join(resp.iter_raw())
            auth = _post(base, {"prompt": "x"}, headers={"Authorization": "Bearer k"}).json()
            models = httpx.get(base + "/v1/models").json()
    assert body == b"".join(ru.sse({"backend": "A", "i": i}) for i in range(3)) + \
        b"data: [DONE]\n\n"
    assert auth == {"backend": "A", "auth": "Bearer k"}
    assert models["data"][0]["id"] == "A"


def test_a_stream_the_backend_breaks_ends_with_an_error_event() -> None:
    with ru.fake_backends("A") as backends:
        with ru.live_router(_config([backends[0][1].base_url])) as (router, base):
            with httpx.stream("POST", base + "/v1/completions", timeout=30,
                              json={"prompt": "x", "stream": True, "break": True}) as resp:
                body = b"".join(resp.iter_raw()).decode()
            wait_until(lambda: router.pool.get(backends[0][1].base_url).outstanding == 0,
                       "the broken stream is released")
    assert body.startswith('data: {"backend": "A", "i": 0}')
    assert '"code": "backend_failed"' in body and "failed mid-stream" in body
    assert body.endswith("data: [DONE]\n\n")


def test_a_client_that_goes_away_mid_stream_ends_the_backends_stream() -> None:
    with ru.fake_backends("A") as backends:
        fake, url = backends[0][0], backends[0][1].base_url
        with ru.live_router(_config([url])) as (router, base):
            with httpx.stream("POST", base + "/v1/completions", timeout=30,
                              json={"prompt": "x", "stream": True, "endless": True}) as resp:
                first = next(resp.iter_raw())
            wait_until(lambda: fake.streams_closed == 1, "the backend sees the disconnect")
            wait_until(lambda: router.pool.get(url).outstanding == 0, "released")
    assert first.startswith(b'data: {"backend": "A", "i": 0}')


def test_failure_before_the_first_byte_is_retried_on_another_backend() -> None:
    with ru.dropping_server() as dead, ru.fake_backends("B") as backends:
        urls = [dead, backends[0][1].base_url]
        with ru.live_router(_config(urls, scrape_metrics=False)) as (router, base):
            router.pool.get(dead).healthy = True  # as if its health check had not run yet
            answers = [_post(base, {"prompt": "x", "stream": s}) for s in (False, True)]
            metrics = httpx.get(base + "/metrics").text
    assert answers[0].json()["backend"] == "B"
    assert answers[1].status_code == 200 and b'"backend": "B"' in answers[1].content
    assert "photon_router:retries_total" in metrics


def test_a_killed_backend_is_taken_out_and_its_index_entries_dropped() -> None:
    with ru.fake_backends("A") as backends, ExitStack() as victim_stack:
        victim = victim_stack.enter_context(serve_app(ru.fake_backend_app(ru.FakeBackend("V"))))
        dead, alive = victim.base_url, backends[0][1].base_url
        with ru.live_router(_config([dead, alive])) as (router, base):
            wait_until(lambda: all(b.healthy for b in router.pool), "both backends are up")
            router.index.store(dead, [1, 2, 3])
            victim_stack.close()  # the backend dies
            answers = [_post(base, {"prompt": "x"}).json()["backend"] for _ in range(4)]
            wait_until(lambda: not router.pool.get(dead).healthy, "the dead one is out", 10)
            health = httpx.get(base + "/health").json()
            assert router.index.blocks_of(dead) == set()
    assert answers == ["A"] * 4
    assert health["backends"] == {dead: "down", alive: "up"}


def test_unhealthy_backend_comes_back_and_none_left_is_a_503() -> None:
    with ru.fake_backends("A") as backends:
        fake, url = backends[0][0], backends[0][1].base_url
        with ru.live_router(_config([url])) as (router, base):
            fake.healthy = False
            wait_until(lambda: not router.pool.get(url).healthy, "marked down", 10)
            answer = _post(base, {"prompt": "x"})
            health = httpx.get(base + "/health")
            fake.healthy = True
            wait_until(lambda: router.pool.get(url).healthy, "back up", 10)
            assert _post(base, {"prompt": "x"}).json()["backend"] == "A"
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "no_healthy_backend"
    assert health.status_code == 503


def test_bad_bodies_are_openai_400s() -> None:
    with ru.fake_backends("A") as backends:
        with ru.live_router(_config([backends[0][1].base_url])) as (_, base):
            not_json = httpx.post(base + "/v1/completions", content=b"{", timeout=30)
            not_object = _post(base, [1, 2])  # type: ignore[arg-type]
    assert not_json.status_code == 400
    assert "not valid JSON" in not_json.json()["error"]["message"]
    assert not_object.json()["error"]["message"] == "the request body must be a JSON object"


def test_least_load_reads_the_backends_gauges() -> None:
    with ru.fake_backends("A", "B") as backends:
        backends[0][0].running = 5
        urls = [s.base_url for _, s in backends]
        with ru.live_router(_config(urls, "least_load")) as (router, base):
            wait_until(lambda: router.pool.get(urls[0]).running == 5, "gauges scraped")
            picks = {_post(base, {"prompt": "x"}).json()["backend"] for _ in range(3)}
    assert picks == {"B"}


def test_backends_file_is_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "backends.txt"
    with ru.fake_backends("A", "B") as backends:
        a, b = (s.base_url for _, s in backends)
        path.write_text(f"# the pool\n{a}\n")
        with ru.live_router(RouterConfig(backends_file=str(path), health_interval_s=0.05)) \
                as (router, base):
            assert router.pool.urls() == [a]
            path.write_text(f"{a}\n{b}  # added\n")
            router.request_reload()  # what SIGHUP does
            wait_until(lambda: router.pool.urls() == [a, b], "the file is reloaded")
            path.write_text("not a url\n")
            router.request_reload()
            wait_until(lambda: not router._reload_requested, "the bad file is read")
            assert router.pool.urls() == [a, b]  # a bad file keeps the old list


@pytest.mark.parametrize("argv, words", [
    (["router"], "no backends: give --backends URL... or --backends-file PATH"),
    (["router", "--backends", "localhost:8000"], "is not an http(s) URL"),
    (["router", "--backends", "http://a:1", "--kv-events", "tcp://a:1", "tcp://b:1"],
     "--kv-events: give one endpoint per --backends URL (1), got 2"),
    (["router", "--backends", "http://a:1", "--block-size", "0"], "--block-size must be >= 1"),
])
def test_cli_errors_are_one_line(argv: list[str], words: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    from photon.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_local_tokenizer_agrees_with_the_servers_tokenize() -> None:
    """--tokenizer gives the ids the server itself derives (its /tokenize), chat included."""
    import asyncio

    from photon.model.tiny import resolve_model_path
    from photon.router.prompts import BackendTokenizer, LocalTokenizer
    from photon.tokenizer import Tokenizer
    from tests.server_util import live_server

    bodies = [
        ("/v1/completions", {"prompt": "The same words, twice: the same words."}),
        ("/v1/completions", {"prompt": "no specials", "add_special_tokens": False}),
        ("/v1/chat/completions", {"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "text", "text": "there"}]}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "add_generation_prompt": False}),
    ]
    local = LocalTokenizer(Tokenizer.from_pretrained(resolve_model_path("photon-tiny-random")))

    async def both(base: str) -> list[tuple[list[int] | None, list[int] | None]]:
        async with httpx.AsyncClient() as client:
            remote = BackendTokenizer(client, lambda: base, 30.0)
            return [(await local.token_ids(p, b), await remote.token_ids(p, b))
                    for p, b in bodies]

    with live_server() as server:
        pairs = asyncio.run(both(server.base_url))
    for mine, theirs in pairs:
        assert mine is not None and mine == theirs
