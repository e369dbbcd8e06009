"""The block hash chain the router computes over a prompt: the engine's own
(`photon.engine.block_hash.block_hashes`), so the hashes in the backends' BlockStored events name
the same blocks.

`BlockHasher(token_ids, block_size) -> list[BlockKey]`: one hash per *full* block of the prompt,
each chained on the one before. The router takes any such function (tests inject their own); a
mismatch with what the backends publish shows at run time: the event subscriber re-hashes every
chain root it sees and counts disagreements (`photon_router:block_hash_mismatches`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from photon.engine.block_hash import block_hashes
from photon.router.events import BlockKey

BlockHasher = Callable[[Sequence[int], int], list[BlockKey]]


def default_block_hasher() -> BlockHasher:
    return block_hashes
