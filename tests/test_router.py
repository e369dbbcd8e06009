"""`photon router`: KV event decoding, the prefix index, the event subscriber (gaps, replay,
restarts), the policies, and the HTTP layer against fake backends."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from photon.router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_event_batch,
)
from photon.router.hashing import chain_block_hashes
from photon.router.index import PrefixIndex
from photon.router.policies import Candidate, PolicyConfig, make_policy
from photon.router.router import RouterConfig, RouterParts
from photon.router.subscriber import (
    EventSubscriber,
    SubscriberConfig,
    replay_endpoint_for,
)
from tests import router_util as ru
from tests.server_util import serve_app, wait_until

pytestmark = pytest.mark.timeout(120)


# ---- events ---------------------------------------------------------------------------------
def test_vllm_layout_decodes_field_by_field() -> None:
    payload = ru.encode([ru.stored([11, 12], parent=None), ru.BlockRemoved([11], "GPU"),
                         ru.AllBlocksCleared()], ts=2.5, rank=1)
    # The wire layout itself: arrays with the tag first, as vLLM's msgspec structs encode.
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 2.5 and raw[2] == 1
    assert raw[1][0] == ["BlockStored", [11, 12], None, list(range(8)), 4, None, "GPU"]
    assert raw[1][1] == ["BlockRemoved", [11], "GPU"]
    assert raw[1][2] == ["AllBlocksCleared"]
    batch = decode_event_batch(payload)
    assert batch.ts == 2.5 and batch.data_parallel_rank == 1
    assert batch.events == [BlockStored([11, 12], None, list(range(8)), 4, None, "GPU"),
                            BlockRemoved([11], "GPU"), AllBlocksCleared()]


def test_decoder_takes_bytes_hashes_short_and_long_layouts() -> None:
    payload = ru.encode([ru.BlockStored([b"\x01" * 32], b"\x02" * 32, [1, 2], 2, None, None)])
    event = decode_event_batch(payload).events[0]
    assert event == BlockStored([b"\x01" * 32], b"\x02" * 32, [1, 2], 2, None, None)
    assert decode_event_batch(payload).data_parallel_rank is None  # omitted: its default
    older = msgspec.msgpack.encode([0.0, [["BlockStored", [5], None, [1], 1, None],
                                          ["BlockRemoved", [5]]]])
    assert decode_event_batch(older).events == [BlockStored([5], None, [1], 1),
                                                BlockRemoved([5])]
    newer = msgspec.msgpack.encode([0.0, [["BlockRemoved", [5], None, "a later field"]], 0, 9])
    assert decode_event_batch(newer).events == [BlockRemoved([5])]


@pytest.mark.parametrize("payload, words", [
    (b"\xc1", "not msgpack"),
    (msgspec.msgpack.encode({"ts": 0}), "must be [ts, events"),
    (msgspec.msgpack.encode([0.0, [["BlockEvicted", [1]]]]), "unknown event tag 'BlockEvicted'"),
    (msgspec.msgpack.encode([0.0, [["BlockStored", [1.5], None, [], 1]]]), "block hash"),
])
def test_decoder_rejects_what_is_not_a_batch(payload: bytes, words: str) -> None:
    with pytest.raises(EventDecodeError, match=re.escape(words)):
        decode_event_batch(payload)


# ---- index ----------------------------------------------------------------------------------
def test_index_follows_stored_removed_cleared() -> None:
    index = PrefixIndex()
    index.apply("a", decode_event_batch(ru.encode([ru.stored([1, 2, 3])])))
    index.apply("b", decode_event_batch(ru.encode([ru.stored([1, 2])])))
    assert index.overlap([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    index.apply("a", decode_event_batch(ru.encode([ru.BlockRemoved([2], None)])))
    # A hole ends the usable prefix: block 3 without block 2 is no hit.
    assert index.overlap([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 2}
    assert index.num_blocks() == 3
    index.apply("b", decode_event_batch(ru.encode([ru.AllBlocksCleared()])))
    assert index.overlap([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 0}
    assert index.blocks_of("a") == {1, 3} and index.blocks_of("b") == set()
    index.drop("a")
    assert index.num_blocks() == 0
    assert index.overlap([], ["a"]) == {"a": 0}


def test_chain_hash_is_stable_and_prefix_closed() -> None:
    tokens = list(range(40))
    hashes = chain_block_hashes(tokens, 16)
    assert len(hashes) == 2  # full blocks only
    assert chain_block_hashes(tokens[:35], 16) == hashes
    assert chain_block_hashes(tokens[:16], 16) == hashes[:1]
    assert chain_block_hashes([0, *tokens[1:]], 16)[0] == hashes[0]
    assert chain_block_hashes([1, *tokens[1:]], 16)[0] != hashes[0]
    assert chain_block_hashes(tokens, 16, extra=7) != hashes
    code = ("from photon.router.hashing import chain_block_hashes; "
            "print(chain_block_hashes(list(range(40)), 16))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONHASHSEED": "123"}, check=True)
    assert other.stdout.strip() == str(hashes)  # the same in every process


# ---- subscriber -----------------------------------------------------------------------------
def _subscriber(index: PrefixIndex, replay: str | None, endpoint: str = "tcp://127.0.0.1:1",
                block_size: int = 4) -> EventSubscriber:
    config = SubscriberConfig("a", endpoint, replay, block_size, replay_timeout_s=5.0)
    return EventSubscriber(config, index, decode_event_batch, chain_block_hashes,
                           zmq.Context.instance())


def test_sequence_gap_is_filled_from_the_replay_socket() -> None:
    buffer = {1: ru.encode([ru.stored([2])]), 2: ru.encode([ru.BlockRemoved([1], None)])}
    index = PrefixIndex()
    with ru.replay_server(buffer) as endpoint:
        sub = _subscriber(index, endpoint)
        sub.on_message(0, ru.encode([ru.stored([1])]))
        sub.on_message(3, ru.encode([ru.stored([3])]))  # 1 and 2 were missed
    assert index.blocks_of("a") == {2, 3}  # the replayed removal of 1 was applied
    assert (sub.stats.gaps, sub.stats.replayed, sub.stats.resets) == (1, 2, 0)


def test_unfillable_gap_drops_the_backend_entries() -> None:
    index = PrefixIndex()
    with ru.replay_server({2: ru.encode([])}) as endpoint:  # batch 1 is no longer buffered
        sub = _subscriber(index, endpoint)
        sub.on_message(0, ru.encode([ru.stored([1])]))
        sub.on_message(3, ru.encode([ru.stored([3])]))
    assert index.blocks_of("a") == {3}  # 1 might have been removed in the lost batch
    assert sub.stats.resets == 1


def test_first_batch_asks_for_the_buffered_history_and_restart_resets() -> None:
    index = PrefixIndex()
    with ru.replay_server({0: ru.encode([ru.stored([7])])}) as endpoint:
        sub = _subscriber(index, endpoint)
        sub.on_message(1, ru.encode([ru.stored([8])]))
    assert index.blocks_of("a") == {7, 8} and sub.stats.resets == 0
    sub.on_message(0, ru.encode([ru.stored([9])]))  # the sequence restarted: a new publisher
    assert index.blocks_of("a") == {9} and sub.stats.resets == 1


def test_root_hash_mismatch_is_counted() -> None:
    index = PrefixIndex()
    sub = _subscriber(index, None)
    tokens = [5, 6, 7, 8]
    sub.on_message(0, ru.encode([ru.stored(chain_block_hashes(tokens, 4), tokens)]))
    assert sub.stats.hash_mismatches == 0
    sub.on_message(1, ru.encode([ru.stored([123], tokens)]))
    sub.on_message(2, ru.encode([ru.stored([124], tokens, parent=123)]))  # not a root: unchecked
    assert sub.stats.hash_mismatches == 1


class Publisher:
    """A PUB socket on a loopback port, with vLLM's (topic, seq, payload) frames."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.seq = 0

    def publish(self, payload: bytes) -> bool:
        self.sock.send_multipart([b"kv-events", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1
        return False

    def until_heard(self, sub: EventSubscriber) -> None:
        """A SUB socket misses what is published before it has connected: publish empty
        batches until one arrives."""
        wait_until(lambda: sub.stats.batches > 0 or self.publish(ru.encode([])), "subscribed")


def test_subscriber_thread_reads_a_pub_socket() -> None:
    pub = Publisher()
    index = PrefixIndex()
    sub = _subscriber(index, None, pub.endpoint)
    sub.start()
    try:
        pub.until_heard(sub)
        pub.publish(ru.encode([ru.stored([42])]))
        wait_until(lambda: index.blocks_of("a") == {42}, "the batch is applied")
    finally:
        sub.stop()
        pub.sock.close(linger=0)
    assert not sub.alive


def test_replay_endpoint_is_beside_the_events_endpoint() -> None:
    assert replay_endpoint_for("tcp://10.0.0.2:5557") == "tcp://10.0.0.2:5558"
    assert replay_endpoint_for("ipc:///tmp/x") is None


# ---- policies -------------------------------------------------------------------------------
def _c(url: str, load: float, cached: int = 0) -> Candidate:
    return Candidate(url, load, cached)


def test_round_robin_and_least_load() -> None:
    rr = make_policy("round_robin")
    picks = [rr.choose([_c("a", 5), _c("b", 0), _c("c", 0)]).url for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]
    ll = make_policy("least_load")
    assert ll.choose([_c("a", 2), _c("b", 1), _c("c", 3)]).url == "b"
    ties = [ll.choose([_c("a", 1), _c("b", 1), _c("c", 3)]).url for _ in range(2)]
    assert sorted(ties) == ["a", "b"]  # equal loads take turns


def test_prefix_aware_cost_ties_and_overload() -> None:
    p = make_policy("prefix_aware", PolicyConfig(prefix_weight=1.0, balance_threshold=4))
    d = p.choose([_c("a", 2, cached=10), _c("b", 0, cached=0)], num_blocks=12)
    assert (d.url, d.reason, d.cached_blocks) == ("a", "prefix", 10)  # 2 + 2 < 0 + 12
    d = p.choose([_c("a", 3, cached=2), _c("b", 1, cached=0)], num_blocks=4)
    assert (d.url, d.reason) == ("b", "tie")  # 2 + 3 == 4 + 1: the less loaded
    d = p.choose([_c("a", 6, cached=10), _c("b", 1, cached=0)], num_blocks=12)
    assert (d.url, d.reason) == ("b", "overload")  # a is cheaper, but 5 above b's load
    d = p.choose([_c("a", 1), _c("b", 0)], num_blocks=12)
    assert (d.url, d.reason) == ("b", "least_load")  # nothing cached anywhere


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'random'; available: "
                                         "least_load, prefix_aware, round_robin"):
        make_policy("random")


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
    assert "photon_router:hit_blocks_total 15.0" in metrics
    assert "photon_router:prompt_blocks_total 27.0" in metrics  # 37 characters: 9 blocks


def test_prefix_index_is_fed_by_the_backends_kv_events() -> None:
    pub = Publisher()
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
