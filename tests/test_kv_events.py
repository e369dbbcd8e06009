"""KV cache events: vLLM's wire layout, the events equal the KV manager's hash-table changes, the
ZeroMQ publisher (sequence numbers, replay, a full queue drops and counts), and the engine end to
end. Sockets are on loopback with ports chosen at run time; every publisher is shut down."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from photon import LLM, SamplingParams
from photon.config import ConfigError
from photon.engine.block_hash import block_hashes
from photon.kv_events.config import KVEventsConfig, offset_endpoint_port, parse_kv_events_config
from photon.kv_events.publisher import ZmqEventPublisher, _SenderThread, create_publisher
from photon.kv_events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_event_batch,
)
from photon.kv_events.subscriber import parse_message, replay
from tests.fake_runner import Harness, make_request

LOOPBACK = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": "tcp://127.0.0.1:*"}


def _plain_decode(payload: bytes) -> Any:
    """An independent msgpack decoder: the msgpack package if installed, else msgspec's
    schema-less one (it knows nothing of photon's structs)."""
    try:
        import msgpack
    except ImportError:
        return msgspec.msgpack.decode(payload)
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


class Index:
    """A subscriber's index: the block hashes an engine holds, rebuilt from its events."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()

    def apply(self, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                assert not self.hashes & set(event.block_hashes), "stored twice"
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.hashes, "removed but never stored"
                self.hashes.difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.hashes.clear()


# ---- wire layout ------------------------------------------------------------------------------
def test_encoding_is_vllms_array_layout() -> None:
    batch = KVEventBatch(12.5, [BlockStored([11, 2 ** 63 - 1], None, [1, 2, 3, 4], 2, None, "GPU"),
                                BlockStored([5], 11, [7, 8], 2, None, "GPU"),
                                BlockRemoved([11], "GPU"), AllBlocksCleared()], 1)
    assert _plain_decode(encode_event_batch(batch)) == [
        12.5,
        [["BlockStored", [11, 2 ** 63 - 1], None, [1, 2, 3, 4], 2, None, "GPU"],
         ["BlockStored", [5], 11, [7, 8], 2, None, "GPU"],
         ["BlockRemoved", [11], "GPU"],
         ["AllBlocksCleared"]],
        1,
    ]


def test_vllm_declarations_decode_our_bytes() -> None:
    # vLLM's declarations (vllm.distributed.kv_events), restated here independently.
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):  # noqa: F811 - vLLM's, shadowing photon's on purpose
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(KVCacheEvent):  # noqa: F811
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):  # noqa: F811
        pass

    class VllmBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    ours = _sample_batch()
    theirs = msgspec.msgpack.Decoder(VllmBatch).decode(encode_event_batch(ours))
    assert theirs.ts == ours.ts and theirs.data_parallel_rank == 0
    assert [msgspec.structs.asdict(e) for e in theirs.events] == \
        [msgspec.structs.asdict(e) for e in ours.events]
    assert [type(e).__name__ for e in theirs.events] == ["BlockStored", "BlockRemoved",
                                                         "AllBlocksCleared"]


def _sample_batch() -> KVEventBatch:
    return KVEventBatch(3.0, [BlockStored([1, 2], 9, list(range(8)), 4, None, "GPU"),
                              BlockRemoved([1], "GPU"), AllBlocksCleared()], 0)


# ---- config -----------------------------------------------------------------------------------
def test_config_defaults_and_errors() -> None:
    on = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv-events"}')
    assert on.publisher == "zmq" and on.publishes and on.endpoint == "tcp://*:5557"
    assert on.buffer_steps == 10_000 and on.hwm == 100_000 and on.max_queue_size == 100_000
    off = parse_kv_events_config({"publisher": "zmq"})
    assert not off.publishes and parse_kv_events_config(None) is None
    assert parse_kv_events_config({}).publisher == "null"
    bad = [("{not json", "must be a JSON object"), ("[1]", "must be a JSON object"),
           ({"enable": True}, "unknown key 'enable'"),
           ({"publisher": "kafka"}, "publisher must be one of zmq, null"),
           ({"endpoint": "localhost:5557"}, "endpoint must be a ZeroMQ address"),
           ({"endpoint": "tcp://*:port"}, "must end with a port number"),
           ({"replay_endpoint": "tcp://*:5557"}, "replay_endpoint must differ"),
           ({"buffer_steps": 0}, "buffer_steps must be an integer >= 1"),
           ({"max_queue_size": True}, "max_queue_size must be an integer >= 1"),
           ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be true or false"),
           ({"topic": 5}, "topic must be a string")]
    for value, message in bad:
        with pytest.raises(ConfigError, match=message):
            parse_kv_events_config(value)


def test_data_parallel_ranks_offset_the_ports() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"
    assert offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint_port(None, 1) is None


# ---- the KV manager's events over a scheduler workload with eviction -------------------------
def test_events_rebuild_the_hash_table_under_eviction() -> None:
    rng = random.Random(7)
    h = Harness(depth=2, max_num_seqs=3, budget=24, num_blocks=14, block_size=4, kv_events=True)
    prefixes = [[rng.randrange(100, 900) for _ in range(12)] for _ in range(3)]
    index, removed = Index(), 0
    for i in range(40):
        prompt = rng.choice(prefixes)[:rng.randrange(4, 13)] + [rng.randrange(100, 900)
                                                              for _ in range(rng.randrange(1, 6))]
        h.add(make_request(f"r{i}", prompt, rng.randrange(1, 6), seed=i))
        for _ in range(rng.randrange(0, 4)):
            if h.busy:
                h.step()
            events = h.kv.take_events()
            removed += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
            index.apply(events)
            assert index.hashes == set(h.kv._hash_to_block)
    h.drain()
    index.apply(h.kv.take_events())
    assert index.hashes == set(h.kv._hash_to_block) and removed > 0
    h.assert_drained()
    assert h.kv.reset_prefix_cache()
    index.apply(h.kv.take_events())
    assert index.hashes == set() == set(h.kv._hash_to_block)


def test_stored_event_fields_match_the_router_hash() -> None:
    h = Harness(depth=1, num_blocks=16, block_size=4, kv_events=True)
    prompt = list(range(100, 108))  # 2 full blocks; the 2 outputs leave block 2 partial
    h.add(make_request("a", prompt, 2, seed=0))
    h.drain()
    assert h.kv.take_events() == [BlockStored(block_hashes(prompt, 4), None, prompt, 4, None,
                                              "GPU")]


def _replayed(ctx: zmq.Context, publisher: ZmqEventPublisher, count: int
              ) -> list[tuple[int, KVEventBatch]]:
    """The replay buffer once it holds `count` batches (the publisher thread may still be
    sending the last ones; polled, bounded)."""
    for _ in range(500):
        batches = replay(ctx, publisher.replay_endpoint, 0)
        if len(batches) >= count:
            return batches
    raise AssertionError(f"the replay buffer never held {count} batches")


# ---- the ZeroMQ publisher ---------------------------------------------------------------------
@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _publisher(**overrides: Any) -> ZmqEventPublisher:
    publisher = create_publisher(KVEventsConfig(**{**LOOPBACK, **overrides}))
    assert isinstance(publisher, ZmqEventPublisher)
    return publisher


def _subscribe(ctx: zmq.Context, publisher: ZmqEventPublisher) -> tuple[zmq.Socket, int]:
    """A SUB socket that receives the publisher's messages: probe batches are published until
    one arrives (bounded), so the subscription is in place. Returns it and the next seq."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    for _ in range(100):
        publisher.publish([])
        if sub.poll(100):
            while sub.poll(200):
                _, seq, _ = parse_message(sub.recv_multipart())
            return sub, seq + 1
    raise AssertionError("the subscription never received a message")


def test_pub_messages_sequence_numbers_and_replay(ctx: zmq.Context) -> None:
    publisher = _publisher(topic="kv-events", buffer_steps=4)
    try:
        sub, first = _subscribe(ctx, publisher)
        for i in range(6):
            publisher.publish([BlockRemoved([i], "GPU")])
        got = []
        for _ in range(6):
            assert sub.poll(5000)
            topic, seq, batch = parse_message(sub.recv_multipart())
            assert topic == b"kv-events" and batch.data_parallel_rank == 0
            got.append((seq, batch.events[0].block_hashes))
        assert got == [(first + i, [i]) for i in range(6)]
        # A subscriber that missed from first + 3 on gets those batches back, in order; only
        # the last buffer_steps batches are kept.
        missed = replay(ctx, publisher.replay_endpoint, first + 3)
        assert [(s, b.events[0].block_hashes) for s, b in missed] == \
            [(first + i, [i]) for i in range(3, 6)]
        assert [s for s, _ in replay(ctx, publisher.replay_endpoint, 0)] == \
            [first + i for i in range(2, 6)]
        sub.close()
    finally:
        publisher.shutdown()
    assert not publisher.thread_alive


def test_full_queue_drops_and_counts_without_blocking(monkeypatch: pytest.MonkeyPatch,
                                                      ctx: zmq.Context) -> None:
    gate, entered = threading.Event(), threading.Event()
    real = _SenderThread._send_queued

    def held(self: _SenderThread) -> None:  # the thread waits here until released
        entered.set()
        assert gate.wait(30)
        real(self)

    monkeypatch.setattr(_SenderThread, "_send_queued", held)
    publisher = _publisher(max_queue_size=2)
    try:
        for i in range(5):  # never blocks: 2 fit in the queue, 3 are dropped
            publisher.publish([BlockRemoved([i], "GPU")])
        assert publisher.dropped == 3
        assert entered.wait(30)
        gate.set()
        _replayed(ctx, publisher, 2)  # the queue is empty again
        publisher.publish([BlockRemoved([5], "GPU")])  # seq 5: the gap shows the loss
        sent = _replayed(ctx, publisher, 3)
        assert [(s, b.events[0].block_hashes) for s, b in sent] == [(0, [0]), (1, [1]), (5, [5])]
        assert publisher.dropped == 3
    finally:
        gate.set()
        publisher.shutdown()
    assert not publisher.thread_alive


def test_an_endpoint_in_use_is_a_clear_error(ctx: zmq.Context) -> None:
    first = _publisher()
    try:
        with pytest.raises(OSError, match="kv_events_config: cannot open endpoint"):
            # a `*` host binds (another host would connect, as vLLM)
            port = first.endpoint.rpartition(":")[2]
            create_publisher(KVEventsConfig(True, endpoint=f"tcp://*:{port}"))
    finally:
        first.shutdown()




# ---- the engine end to end --------------------------------------------------------------------
def test_engine_publishes_its_cache_changes(ctx: zmq.Context) -> None:
    llm = LLM("photon-tiny-random", max_model_len=40, num_gpu_blocks_override=12, block_size=4,
              max_num_seqs=4, kv_events_config=LOOPBACK)
    engine = llm.engine
    try:
        rng = random.Random(3)
        shared = [rng.randrange(10, 300) for _ in range(16)]
        prompts = [shared[:rng.randrange(4, 17)] + [rng.randrange(10, 300)
                                                   for _ in range(rng.randrange(1, 9))]
                   for _ in range(12)]
        llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        cached = set(engine.kv._hash_to_block)
        assert engine.reset_prefix_cache()
        publisher = engine.kv_events
        batches = _replayed(ctx, publisher, next(publisher._seq))  # (that seq is never sent)
        assert [seq for seq, _ in batches] == list(range(len(batches)))
        index, kinds = Index(), set()
        for _, batch in batches[:-1]:
            assert batch.data_parallel_rank == 0
            index.apply(batch.events)
            kinds.update(type(e).__name__ for e in batch.events)
        assert kinds == {"BlockStored", "BlockRemoved"}  # the workload evicted blocks
        assert index.hashes == cached and cached
        assert batches[-1][1].events == [AllBlocksCleared()]
        assert engine.stats().kv_events_dropped == 0
    finally:
        engine.shutdown()
    assert not engine.kv_events.thread_alive


def test_cli_flag_reaches_the_engine_config() -> None:
    import argparse

    from photon.cli import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--model", "photon-tiny-random", "--kv-events-config",
                            '{"enable_kv_cache_events": true, "topic": "kv-events"}'])
    config = engine_args_from(ns).create_config()
    assert config.kv_events_config == KVEventsConfig(True, "zmq", topic="kv-events")
    ns = parser.parse_args(["--model", "photon-tiny-random", "--kv-events-config", '{"hwm": -1}'])
    with pytest.raises(ConfigError, match=r"kv_events_config \(--kv-events-config\): hwm"):
        engine_args_from(ns).create_config()
