"""Backend pools: which instance takes the next request (least outstanding requests, ties in
turn), and their in-flight counts. Used only on the proxy's event loop (no locks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Backend:
    url: str
    outstanding: int = 0  # requests sent to it and not yet answered in full


class Pool:
    def __init__(self, name: str, urls: tuple[str, ...]) -> None:
        self.name = name  # "prefill" or "decode"
        self.backends = [Backend(u) for u in urls]
        self._turn = 0

    def order(self) -> list[Backend]:
        """Every backend, the one to try first first: least outstanding requests, ties broken
        by turns (equal load is round robin); the rest are the failover order."""
        n = len(self.backends)
        start = self._turn % n
        self._turn += 1
        rotated = self.backends[start:] + self.backends[:start]
        return sorted(rotated, key=lambda b: b.outstanding)  # stable: the turn order stays
