"""PrefixIndex: block hash -> the backends that hold that block, fed by KV events.

One lock guards both maps; every method does in-memory work only, so the lock is never held
across I/O (event subscribers decode outside it, the HTTP path tokenizes and hashes outside it).
Invariant: `b in _where[h]` iff `h in _held[b]`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from photon.router.events import (
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)


class PrefixIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._where: dict[BlockKey, set[str]] = {}
        self._held: dict[str, set[BlockKey]] = {}

    def apply(self, backend: str, batch: KVEventBatch) -> None:
        with self._lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._store(backend, event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self._remove(backend, event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self._clear(backend)

    def store(self, backend: str, hashes: Iterable[BlockKey]) -> None:
        with self._lock:
            self._store(backend, hashes)

    def drop(self, backend: str) -> None:
        """Forget everything `backend` holds (it went down, restarted, or lost events)."""
        with self._lock:
            self._clear(backend)

    def _store(self, backend: str, hashes: Iterable[BlockKey]) -> None:
        held = self._held.setdefault(backend, set())
        for h in hashes:
            self._where.setdefault(h, set()).add(backend)
            held.add(h)

    def _remove(self, backend: str, hashes: Iterable[BlockKey]) -> None:
        held = self._held.get(backend)
        if held is None:
            return
        for h in hashes:
            if h in held:
                held.discard(h)
                self._unlink(h, backend)

    def _clear(self, backend: str) -> None:
        for h in self._held.pop(backend, set()):
            self._unlink(h, backend)

    def _unlink(self, h: BlockKey, backend: str) -> None:
        owners = self._where[h]
        owners.discard(backend)
        if not owners:
            del self._where[h]

    def overlap(self, hashes: Sequence[BlockKey], backends: Sequence[str]) -> dict[str, int]:
        """For each of `backends`: how many leading blocks of the chain `hashes` it holds (a
        prefix cache can only reuse an unbroken run from the first block)."""
        matched = dict.fromkeys(backends, 0)
        alive = set(backends)
        with self._lock:
            for i, h in enumerate(hashes):
                owners = self._where.get(h, ())
                for b in [b for b in alive if b not in owners]:
                    alive.discard(b)
                    matched[b] = i
                if not alive:
                    break
            else:
                for b in alive:
                    matched[b] = len(hashes)
        return matched

    def num_blocks(self) -> int:
        """Distinct block hashes held by any backend."""
        with self._lock:
            return len(self._where)

    def blocks_of(self, backend: str) -> set[BlockKey]:
        with self._lock:
            return set(self._held.get(backend, ()))
