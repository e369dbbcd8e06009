"""GrammarCache: compile futures by spec key, least recently used first, bounded in bytes.

An entry's size is its key's text plus, once compiled, the compiled grammar's memory (as the
backend reports it); a failed compile stays cached at its key's size (the same bad spec is
answered at once), a compile in progress counts its key only. Eviction drops least recently used
entries until the total fits, skipping pinned ones: a request that holds a compile future but has
not opened its matcher yet pins the entry, because the grammar worker's copy goes with it. Every
method returns the keys it dropped, so the caller tells the executor to forget them.
Not thread-safe: the manager calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass(eq=False)
class _Entry:
    future: Future
    nbytes: int
    pins: int = 0


class GrammarCache:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def get(self, key: tuple) -> Future | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.future

    def put(self, key: tuple, future: Future) -> list[tuple]:
        """A compile just submitted for `key` (replacing any entry of it)."""
        dropped = self.pop(key)
        entry = _Entry(future, _key_bytes(key))
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        return dropped + self._evict()

    def compiled(self, key: tuple, future: Future, nbytes: int) -> list[tuple]:
        """`future` finished with a grammar of `nbytes` (0: it failed): its entry (if still
        cached) grows by that."""
        entry = self._entries.get(key)
        if entry is None or entry.future is not future:
            return []
        entry.nbytes += nbytes
        self.nbytes += nbytes
        return self._evict()

    def pin(self, key: tuple, future: Future) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.future is future:
            entry.pins += 1

    def unpin(self, key: tuple, future: Future) -> list[tuple]:
        entry = self._entries.get(key)
        if entry is None or entry.future is not future:
            return []
        entry.pins -= 1
        return self._evict()

    def pop(self, key: tuple, future: Future | None = None) -> list[tuple]:
        """Drop `key` (only if its entry holds `future`, when given)."""
        entry = self._entries.get(key)
        if entry is None or (future is not None and entry.future is not future):
            return []
        del self._entries[key]
        self.nbytes -= entry.nbytes
        return [key]

    def _evict(self) -> list[tuple]:
        dropped = []
        for key in list(self._entries):
            if self.nbytes <= self.limit_bytes:
                break
            if self._entries[key].pins == 0:
                dropped += self.pop(key)
        return dropped


def _key_bytes(key: tuple) -> int:
    return sum(len(part) for part in key if isinstance(part, str))
