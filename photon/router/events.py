"""KV cache events as vLLM publishes them, decoded from msgpack.

Layout (vLLM's `vllm/distributed/kv_events.py`: msgspec structs, `array_like=True`, tagged by
class name, trailing defaults omitted):

    KVEventBatch      = [ts: float, events: [event, ...], data_parallel_rank: int | None]
    BlockStored       = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                         lora_id, medium]
    BlockRemoved      = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared  = ["AllBlocksCleared"]

A block hash is an int or, in newer vLLM, bytes; either is kept as it arrives (`BlockKey`).
Decoding is positional over msgspec's generic msgpack decoder, so fields a newer publisher
appends after the known ones are ignored and older publishers that omit trailing fields
(`medium`, `data_parallel_rank`) decode too. Anything else is an `EventDecodeError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import msgspec

BlockKey = Union[int, bytes]


class EventDecodeError(ValueError):
    """A payload that is not a KVEventBatch in vLLM's layout."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[BlockKey]
    parent_block_hash: BlockKey | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[BlockKey]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# A decoder turns one PUB payload into a batch (the router takes any such callable).
EventDecoder = Callable[[bytes], KVEventBatch]


def _key(value: Any, what: str) -> BlockKey:
    if isinstance(value, (int, bytes)) and not isinstance(value, bool):
        return value
    raise EventDecodeError(f"{what}: expected an int or bytes block hash, got {value!r}")


def _keys(value: Any, what: str) -> list[BlockKey]:
    if not isinstance(value, list):
        raise EventDecodeError(f"{what}: expected a list of block hashes, got {value!r}")
    return [_key(v, what) for v in value]


def _stored(fields: list[Any]) -> BlockStored:
    if len(fields) < 4:
        raise EventDecodeError(f"BlockStored needs at least 4 fields, got {len(fields)}")
    hashes, parent, tokens, size = fields[:4]
    if not isinstance(tokens, list) or not isinstance(size, int):
        raise EventDecodeError("BlockStored: token_ids must be a list and block_size an int")
    rest = [*fields[4:6], None, None][:2]
    return BlockStored(_keys(hashes, "BlockStored.block_hashes"),
                       None if parent is None else _key(parent, "BlockStored.parent_block_hash"),
                       tokens, size, rest[0], rest[1])


def _removed(fields: list[Any]) -> BlockRemoved:
    if not fields:
        raise EventDecodeError("BlockRemoved needs its block_hashes")
    medium = fields[1] if len(fields) > 1 else None
    return BlockRemoved(_keys(fields[0], "BlockRemoved.block_hashes"), medium)


_EVENTS: dict[str, Callable[[list[Any]], KVEvent]] = {
    "BlockStored": _stored, "BlockRemoved": _removed,
    "AllBlocksCleared": lambda _fields: AllBlocksCleared()}


def _event(raw: Any) -> KVEvent:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise EventDecodeError(f"an event must be an array starting with its tag, got {raw!r}")
    parse = _EVENTS.get(raw[0])
    if parse is None:
        raise EventDecodeError(f"unknown event tag {raw[0]!r}; known: {', '.join(_EVENTS)}")
    return parse(raw[1:])


def decode_event_batch(payload: bytes) -> KVEventBatch:
    """One PUB (or replay) payload -> KVEventBatch; EventDecodeError when it is not one."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise EventDecodeError(f"not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise EventDecodeError(f"a batch must be [ts, events, ...], got {type(raw).__name__}")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return KVEventBatch(float(ts), [_event(e) for e in events], rank)
