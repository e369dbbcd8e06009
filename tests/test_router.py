"""`photon router`: KV event decoding, the prefix index, the event subscriber (gaps, replay,
restarts), the policies, and the HTTP layer against fake backends."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import msgspec
import pytest
import zmq

from photon.engine.block_hash import block_hashes as chain_block_hashes
from photon.router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_event_batch,
)
from photon.router.index import PrefixIndex
from photon.router.pending import PendingBlocks
from photon.router.policies import Candidate, PolicyConfig, make_policy
from photon.router.router import Router, RouterConfig, RouterParts
from photon.router.subscriber import (
    EventSubscriber,
    SubscriberConfig,
    replay_endpoint_for,
)
from tests import router_util as ru
from tests.server_util import wait_until

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
    assert chain_block_hashes(tokens, 16, extra=(7,)) != hashes
    code = ("from photon.engine.block_hash import block_hashes as chain_block_hashes; "
            "print(chain_block_hashes(list(range(40)), 16))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONHASHSEED": "123"}, check=True)
    assert other.stdout.strip() == str(hashes)  # the same in every process


# ---- pending (in-flight) blocks -------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pending_blocks_count_as_cached_until_the_backend_confirms_them() -> None:
    clock = FakeClock()
    index = PrefixIndex(pending_ttl_s=30.0, clock=clock)
    index.add_pending("a", [1, 2, 3])
    assert index.overlap([1, 2, 3, 4], ["a", "b"]) == {"a": 3, "b": 0}
    assert index.num_blocks() == 0 and index.num_pending() == 3  # not held: pending
    index.apply("a", decode_event_batch(ru.encode([ru.stored([1, 2])])))
    assert index.pending_of("a") == {3} and index.blocks_of("a") == {1, 2}  # 1, 2 confirmed
    assert index.overlap([1, 2, 3, 4], ["a"]) == {"a": 3}
    index.apply("a", decode_event_batch(ru.encode([ru.BlockRemoved([3], None)])))
    assert index.pending_of("a") == set()
    assert index.overlap([1, 2, 3], ["a"]) == {"a": 2}


def test_pending_blocks_expire_after_their_ttl() -> None:
    clock = FakeClock()
    index = PrefixIndex(pending_ttl_s=30.0, clock=clock)
    index.add_pending("a", [1, 2])
    clock.now += 29.0
    index.add_pending("a", [2, 3])  # renewed: 2 and 3 live 30 s from now
    assert index.overlap([1, 2, 3], ["a"]) == {"a": 3}
    clock.now += 1.0  # block 1's 30 s are over
    assert index.overlap([1, 2, 3], ["a"]) == {"a": 0}  # a hole at the first block
    assert index.overlap([2, 3], ["a"]) == {"a": 2}
    assert index.num_pending() == 2
    clock.now += 30.0
    assert index.num_pending() == 0 and index.overlap([2, 3], ["a"]) == {"a": 0}


def test_pending_blocks_go_with_cleared_dropped_or_failed() -> None:
    index = PrefixIndex(clock=FakeClock())
    index.add_pending("a", [1, 2])
    index.add_pending("b", [1, 2])
    index.apply("a", decode_event_batch(ru.encode([ru.AllBlocksCleared()])))
    index.drop("b")
    assert index.overlap([1, 2], ["a", "b"]) == {"a": 0, "b": 0}
    index.add_pending("a", [1, 2])
    index.forget_pending("a", [1, 2])
    assert index.num_pending() == 0
    with pytest.raises(ValueError, match="TTL must be > 0 seconds, got 0"):
        PendingBlocks(0)


def _prefix_router(clock: FakeClock, ttl_s: float = 30.0) -> Router:
    config = RouterConfig(backends=("http://a:1", "http://b:1", "http://c:1"),
                          policy="prefix_aware", pending_ttl_s=ttl_s)
    return Router(config, RouterParts(clock=clock))


def test_concurrent_first_turns_of_a_group_go_to_one_backend() -> None:
    clock = FakeClock()
    router = _prefix_router(clock)
    system = [101, 102, 103, 104]  # the shared system prompt's blocks
    # Four conversations' first turns, all sent before any backend has stored a block.
    picks = [router.choose([*system, 200 + i]) for i in range(4)]
    assert len({d.url for d in picks}) == 1
    assert [d.cached_blocks for d in picks] == [0, 4, 4, 4]
    other = router.choose([301, 302, 303])  # another group: no pending blocks anywhere
    assert other is not None and other.reason == "least_load"
    clock.now += 31.0  # never confirmed (the requests failed silently): the claim lapses
    assert router.choose([*system, 999]).cached_blocks == 0


def test_a_failed_or_downed_backend_loses_its_pending_blocks() -> None:
    router = _prefix_router(FakeClock())
    first = router.choose([1, 2, 3])
    assert first is not None
    router.not_sent(first.url, [1, 2, 3])  # it failed there before its first byte
    assert router.index.num_pending() == 0
    second = router.choose([1, 2, 3])
    assert second is not None and router.index.pending_of(second.url) == {1, 2, 3}
    router.mark_down(second.url, "test")
    assert router.index.num_pending() == 0


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


def test_subscriber_thread_reads_a_pub_socket() -> None:
    pub = ru.Publisher()
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
