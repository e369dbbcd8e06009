"""PrefixIndex: block hash -> the backends that hold that block, fed by KV events, plus the
blocks the router has just sent to a backend and that its events have not confirmed yet
(`PendingBlocks`: in-flight routing counts as cached until confirmed, removed or expired).

One lock guards the maps; every method does in-memory work only, so the lock is never held
across I/O (event subscribers decode outside it, the HTTP path tokenizes and hashes outside it).
Invariant: `b in _where[h]` iff `h in _held[b]`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

from photon.router.events import (
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from photon.router.pending import DEFAULT_PENDING_TTL_S, PendingBlocks


class PrefixIndex:
    def __init__(self, pending_ttl_s: float = DEFAULT_PENDING_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._where: dict[BlockKey, set[str]] = {}
        self._held: dict[str, set[BlockKey]] = {}
        self._pending = PendingBlocks(pending_ttl_s)
        self._clock = clock

    def apply(self, backend: str, batch: KVEventBatch) -> None:
        with self._lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._store(backend, event.block_hashes)
                    self._pending.discard(backend, event.block_hashes)  # confirmed
                elif isinstance(event, BlockRemoved):
                    self._remove(backend, event.block_hashes)
                    self._pending.discard(backend, event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self._clear(backend)

    def store(self, backend: str, hashes: Iterable[BlockKey]) -> None:
        with self._lock:
            self._store(backend, hashes)

    def drop(self, backend: str) -> None:
        """Forget everything `backend` holds or has pending (it went down, restarted, or lost
        events)."""
        with self._lock:
            self._clear(backend)

    def add_pending(self, backend: str, hashes: Iterable[BlockKey]) -> None:
        """`backend` is about to prefill the chain `hashes`: count its blocks as held there
        until its events confirm them or the TTL passes."""
        now = self._clock()
        with self._lock:
            self._pending.add(backend, hashes, now)

    def forget_pending(self, backend: str, hashes: Iterable[BlockKey]) -> None:
        """The request carrying `hashes` never reached `backend` (it failed before a byte)."""
        with self._lock:
            self._pending.discard(backend, hashes)

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
        self._pending.clear(backend)
        for h in self._held.pop(backend, set()):
            self._unlink(h, backend)

    def _unlink(self, h: BlockKey, backend: str) -> None:
        owners = self._where[h]
        owners.discard(backend)
        if not owners:
            del self._where[h]

    def overlap(self, hashes: Sequence[BlockKey], backends: Sequence[str]) -> dict[str, int]:
        """For each of `backends`: how many leading blocks of the chain `hashes` it holds or has
        pending (a prefix cache can only reuse an unbroken run from the first block)."""
        matched = dict.fromkeys(backends, 0)
        alive = set(backends)
        now = self._clock()
        with self._lock:
            for i, h in enumerate(hashes):
                owners = self._where.get(h, ())
                for b in [b for b in alive
                          if b not in owners and not self._pending.holds(b, h, now)]:
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

    def num_pending(self) -> int:
        """Pending (backend, block) entries, expired ones purged first."""
        now = self._clock()
        with self._lock:
            self._pending.expire(now)
            return self._pending.count()

    def blocks_of(self, backend: str) -> set[BlockKey]:
        """The blocks `backend`'s events say it holds (pending ones not included)."""
        with self._lock:
            return set(self._held.get(backend, ()))

    def pending_of(self, backend: str) -> set[BlockKey]:
        now = self._clock()
        with self._lock:
            return self._pending.of(backend, now)
