"""PendingBlocks: the prompt blocks the router has just sent to a backend, before that backend's
own KV events confirm them (SGLang's approximate tree: in-flight routing counts as cached).

Without it, the concurrent first turns of conversations that share a system prompt all see an
empty index and spread over the backends, so each backend prefills the shared prompt. With it,
the second request already finds the first one's blocks "cached" where the first one went.

An entry lives until the backend's BlockStored confirms it (the PrefixIndex then holds it), its
BlockRemoved or AllBlocksCleared arrives, the backend's entries are dropped (down, restarted,
events lost), or `ttl_s` passes (the request failed, or the backend never stored that block).
Not thread-safe: its owner (PrefixIndex) calls it under its lock. The clock is passed in, so that
expiry is testable without waiting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from photon.router.events import BlockKey

DEFAULT_PENDING_TTL_S = 30.0


class PendingBlocks:
    def __init__(self, ttl_s: float = DEFAULT_PENDING_TTL_S) -> None:
        if not ttl_s > 0:
            raise ValueError(f"the pending blocks' TTL must be > 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        # backend -> block -> expiry time. Insertion order is expiry order (one TTL, a monotonic
        # clock, and a renewed entry moves to the end), so expiry pops from the front.
        self._expiry: dict[str, OrderedDict[BlockKey, float]] = {}

    def add(self, backend: str, hashes: Iterable[BlockKey], now: float) -> None:
        entries = self._expiry.setdefault(backend, OrderedDict())
        self._expire(backend, now)
        for h in hashes:
            entries[h] = now + self.ttl_s
            entries.move_to_end(h)

    def discard(self, backend: str, hashes: Iterable[BlockKey]) -> None:
        entries = self._expiry.get(backend)
        if entries is None:
            return
        for h in hashes:
            entries.pop(h, None)

    def clear(self, backend: str) -> None:
        self._expiry.pop(backend, None)

    def holds(self, backend: str, h: BlockKey, now: float) -> bool:
        expiry = self._expiry.get(backend, {}).get(h)
        return expiry is not None and expiry > now

    def expire(self, now: float) -> None:
        for backend in list(self._expiry):
            self._expire(backend, now)

    def _expire(self, backend: str, now: float) -> None:
        entries = self._expiry[backend]
        while entries:
            h, expiry = next(iter(entries.items()))
            if expiry > now:
                break
            del entries[h]

    def count(self) -> int:
        return sum(len(e) for e in self._expiry.values())

    def of(self, backend: str, now: float) -> set[BlockKey]:
        return {h for h, t in self._expiry.get(backend, {}).items() if t > now}
