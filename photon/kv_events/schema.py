"""The KV cache event schema, in vLLM's wire layout (vllm.distributed.kv_events).

Every struct is a msgspec array-like struct (as vLLM declares them): it encodes as a msgpack
array of its fields in declaration order. The events are tagged: the first element is the class name. So a batch is
    [ts, [event, ...], data_parallel_rank]
and the events are
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]
Block hashes are photon.engine.block_hash values (ints in [0, 2**63)); parent_block_hash is None
for the first block of a sequence. One BlockStored covers consecutive blocks of one sequence:
token_ids holds their tokens, block_size of them per hash. medium is "GPU": the engine's own KV
cache tier (the name vLLM uses for it, on every device).

`decode_event_batch(payload)` reads one published payload back (routers use it).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the engine step that produced the events ended
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events (the tag is the subclass's name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_event_batch(payload: bytes) -> KVEventBatch:
    """One published payload (the third frame of a PUB message, or the second of a replay
    reply) -> the batch; msgspec.DecodeError if it is not one."""
    return _DECODER.decode(payload)


def encode_event_batch(batch: KVEventBatch) -> bytes:
    return msgspec.msgpack.encode(batch)
