"""The backends: their URLs, health and load. BackendPool owns this state; it is read and written
on the router's event loop only (the event subscribers touch the PrefixIndex, not the pool)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_KV_EVENTS_PORT = 5557  # vLLM's default KV events endpoint port


def normalize_url(url: str) -> str:
    """`http(s)://host:port[/prefix]` without a trailing slash; ValueError naming what is wrong."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"backend {url!r} is not an http(s) URL (give e.g. "
                         f"http://127.0.0.1:8000)")
    return url


def default_events_endpoint(url: str) -> str:
    """The KV events endpoint of the backend at `url`: its host, port 5557 (vLLM's default)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{DEFAULT_KV_EVENTS_PORT}"


ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Listed:
    """The backends as listed (flags and file): plain ones, or prefill and decode instances."""
    plain: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill or self.decode)

    @property
    def routed(self) -> tuple[str, ...]:
        """The backends the policy chooses among: the prefill instances, or the plain ones."""
        return self.prefill if self.disaggregated else self.plain

    def __add__(self, other: Listed) -> Listed:
        return Listed(self.plain + other.plain, self.prefill + other.prefill,
                      self.decode + other.decode)

    def check(self) -> Listed:
        """Itself, normalized; ValueError naming what is wrong."""
        out = Listed(*(tuple(normalize_url(u) for u in urls)
                       for urls in (self.plain, self.prefill, self.decode)))
        if not (out.plain or out.disaggregated):
            raise ValueError("no backends: give --backends URL... or --backends-file PATH "
                             "(or --prefill URL... --decode URL...)")
        if out.plain and out.disaggregated:
            raise ValueError("plain backends (--backends, or a file line without a role) cannot "
                             "be mixed with prefill/decode instances (--prefill, --decode)")
        if out.disaggregated and not (out.prefill and out.decode):
            raise ValueError(f"prefill/decode disaggregation needs at least one instance of each "
                             f"role: got {len(out.prefill)} prefill (--prefill) and "
                             f"{len(out.decode)} decode (--decode)")
        every = out.plain + out.prefill + out.decode
        twice = sorted({u for u in every if every.count(u) > 1})
        if twice:
            raise ValueError(f"backends: listed twice: {', '.join(twice)} (an instance has one "
                             f"role)")
        return out


def read_backends_file(path: str) -> Listed:
    """One backend a line: `URL`, or `prefill URL` / `decode URL` for the instances of
    prefill/decode disaggregation; blank lines and `#` comments are skipped."""
    with open(path, encoding="utf-8") as f:
        lines = [line.split("#", 1)[0].split() for line in f]
    found: dict[str, list[str]] = {"plain": [], "prefill": [], "decode": []}
    for number, words in enumerate(lines, 1):
        if len(words) == 1:
            found["plain"].append(normalize_url(words[0]))
        elif len(words) == 2 and words[0] in ROLES:
            found[words[0]].append(normalize_url(words[1]))
        elif words:
            raise ValueError(f"{path}:{number}: {' '.join(words)!r} is not a backend line; "
                             f"give URL, or prefill URL, or decode URL")
    return Listed(*(tuple(found[k]) for k in ("plain", "prefill", "decode")))


@dataclass
class Backend:
    url: str
    events_endpoint: str | None = None
    healthy: bool = True  # until a health check or a failed request says otherwise
    outstanding: int = 0  # requests the router has in flight there
    running: float = 0.0  # the backend's own gauges, from its /metrics (0 until scraped)
    waiting: float = 0.0

    @property
    def load(self) -> float:
        """Requests there: what the router sent, or what the backend reports if more (other
        clients, or requests the router has already forgotten)."""
        return max(float(self.outstanding), self.running + self.waiting)


class BackendPool:
    def __init__(self, urls: Sequence[str], events: Mapping[str, str] | None = None) -> None:
        self._backends: dict[str, Backend] = {}
        self._events = dict(events or {})  # explicit KV events endpoints; others: the default
        self.replace(urls)

    def replace(self, urls: Sequence[str]) -> tuple[list[str], list[str]]:
        """Set the backend list (kept state for URLs already known); returns (added, removed)."""
        urls = [normalize_url(u) for u in urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"backends: a URL is listed twice in {urls}")
        removed = [u for u in self._backends if u not in urls]
        added = [u for u in urls if u not in self._backends]
        for u in added:
            self._backends[u] = Backend(u, self._events.get(u) or default_events_endpoint(u))
        self._backends = {u: self._backends[u] for u in urls}  # the listed order
        return added, removed

    def __iter__(self) -> Iterable[Backend]:  # type: ignore[override]
        return iter(list(self._backends.values()))

    def get(self, url: str) -> Backend | None:
        return self._backends.get(url)

    def urls(self) -> list[str]:
        return list(self._backends)

    def healthy(self, exclude: Iterable[str] = ()) -> list[Backend]:
        skip = set(exclude)
        return [b for b in self._backends.values() if b.healthy and b.url not in skip]


def file_mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None
