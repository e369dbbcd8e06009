"""Deterministic KV block hashes: the prefix cache's keys, and the ids in KV cache events.

Block i of a token sequence (tokens [i * block_size, (i + 1) * block_size)) is identified by a
hash chain: h_0 = hash_block(ROOT_HASH, block 0), h_i = hash_block(h_{i-1}, block i). Only full
blocks have hashes. Every process computes the same values (no per-process seed: not Python's
`hash()`), so a router in another process can hash a prompt with `block_hashes` and look the
values up among the `BlockStored` events an engine published.

The hash is BLAKE2b (8-byte digest) over a fixed little-endian layout:
    parent hash (u64) | number of tokens (u32) | each token id (i64) | extra keys (JSON, optional)
keeping the top 63 bits, so a value is an integer in [0, 2**63): consumers that store block hashes
as signed or as unsigned 64-bit integers read the same number. It runs once per full block.

`extra` (default None) holds what else determines a block's KV besides its tokens, such as a
LoRA adapter id: `(lora_id,)`. Its entries are ints or strings; None and `()` differ.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

HASH_BITS = 63
_HEADER = struct.Struct("<QI")


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


# Parent hash of the first block of every chain.
ROOT_HASH = _digest(b"photon-kv-root")

ExtraKeys = Sequence[int | str]


def _pack_extra(extra: ExtraKeys) -> bytes:
    for key in extra:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise TypeError(f"block hash extra keys must be ints or strings, got {key!r}")
    return json.dumps(list(extra), separators=(",", ":"), ensure_ascii=True).encode("ascii")


def hash_block(parent_hash: int, tokens: Sequence[int], extra: ExtraKeys | None = None) -> int:
    """One chain step: the hash of a block with these token ids after the block `parent_hash`
    (ROOT_HASH for the first block)."""
    n = len(tokens)
    data = _HEADER.pack(parent_hash, n) + struct.pack(f"<{n}q", *tokens)
    if extra is not None:
        data += _pack_extra(extra)
    return _digest(data)


def block_hashes(token_ids: Sequence[int], block_size: int,
                 extra: ExtraKeys | None = None) -> list[int]:
    """The chain hashes of every full block of `token_ids`, in order (a trailing partial block
    has none). Equal to the engine's prefix-cache keys for the same tokens and block size.

    The engine matches a prompt's cached prefix on at most its first (len - 1) // block_size
    blocks (at least one prompt token is always computed)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes
