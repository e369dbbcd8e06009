"""The block hash chain the router computes over a prompt: it must equal the engine's, so that
the hashes in the backends' BlockStored events name the same blocks.

`BlockHasher(token_ids, block_size) -> list[BlockKey]`: one hash per *full* block of the prompt,
each chained on the one before (h_i = H(h_{i-1}, tokens of block i)). The router takes any such
function; `default_block_hasher()` is the engine's own `photon.engine.block_hash.block_hashes`
when photon provides it, else `chain_block_hashes` below (a stable sha256 chain any process
computes identically). A mismatch shows at run time: the event subscriber re-hashes every chain
root it sees and counts disagreements (`photon_router:block_hash_mismatches`).
"""

from __future__ import annotations

import hashlib
import importlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

from photon.router.events import BlockKey

BlockHasher = Callable[[Sequence[int], int], list[BlockKey]]

ROOT_PARENT = 0  # the parent hash of a chain's first block


def chain_block_hashes(token_ids: Sequence[int], block_size: int,
                       extra: Any = None) -> list[BlockKey]:
    """sha256 over (parent hash, block tokens[, extra]) truncated to an unsigned 64-bit int."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[BlockKey] = []
    parent = ROOT_PARENT
    salt = b"" if extra is None else repr(extra).encode()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        data = struct.pack(f"<Q{len(block)}q", parent, *block) + salt
        parent = int.from_bytes(hashlib.sha256(data).digest()[:8], "little")
        out.append(parent)
    return out


def default_block_hasher() -> BlockHasher:
    """The engine's public chain hash when this photon has it, else `chain_block_hashes`."""
    try:
        module = importlib.import_module("photon.engine.block_hash")
    except ImportError:
        return chain_block_hashes
    fn = getattr(module, "block_hashes", None)
    return fn if callable(fn) else chain_block_hashes
