"""Prefix-cache counters of the servers' /metrics, for `photon bench serve`.

A run's prefix hit rate and the prompt tokens the servers really computed come from counters
read before and after it on every server (the backends behind a router, or the one server):
`PREFIX:prefix_cache_queries` and `PREFIX:prefix_cache_hits` (tokens looked up / found in the
prefix cache) and `PREFIX:prompt_tokens` (prompt tokens of finished requests), photon's
`photon:` names and vLLM's `vllm:` ones, every label set summed. Prefill tokens computed =
prompt tokens - hits. A server that cannot be read makes the fields None.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_SAMPLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*:(prefix_cache_queries|prefix_cache_hits|"
                     r"prompt_tokens)(?:_total)?(?:\{[^}]*\})?\s+(\S+)")


@dataclass(frozen=True)
class PrefixCounters:
    queries: float = 0.0
    hits: float = 0.0
    prompt_tokens: float = 0.0

    def __add__(self, other: PrefixCounters) -> PrefixCounters:
        return PrefixCounters(self.queries + other.queries, self.hits + other.hits,
                              self.prompt_tokens + other.prompt_tokens)

    def __sub__(self, other: PrefixCounters) -> PrefixCounters:
        return PrefixCounters(self.queries - other.queries, self.hits - other.hits,
                              self.prompt_tokens - other.prompt_tokens)


def parse_prefix_counters(text: str) -> PrefixCounters:
    """The counters in a Prometheus text exposition (0 for those it lacks)."""
    totals = {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0, "prompt_tokens": 0.0}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is not None:
            totals[m.group(1)] += float(m.group(2))
    return PrefixCounters(totals["prefix_cache_queries"], totals["prefix_cache_hits"],
                          totals["prompt_tokens"])


async def _fetch_one(session: Any, url: str, headers: dict[str, str]) -> PrefixCounters | None:
    try:
        async with session.get(url.rstrip("/") + "/metrics", headers=headers) as resp:
            if resp.status != 200:
                return None
            return parse_prefix_counters(await resp.text())
    except Exception:  # noqa: BLE001 - a server without /metrics gives no prefix fields
        return None


async def fetch_prefix_counters(cfg: Any, urls: Sequence[str]) -> list[PrefixCounters | None]:
    """Each server's counters (None for one that cannot be read)."""
    from photon.bench.serve_client import make_session

    async with make_session(cfg, len(urls)) as session:
        return list(await asyncio.gather(*(_fetch_one(session, u, cfg.headers())
                                           for u in urls)))


def prefix_fields(before: Sequence[PrefixCounters | None],
                  after: Sequence[PrefixCounters | None]) -> dict[str, Any]:
    """The run's prefix-cache fields, summed over the servers; None unless every read worked."""
    if any(c is None for c in [*before, *after]):
        return {"prefix_cache_queries": None, "prefix_cache_hits": None,
                "prefix_hit_rate": None, "server_prompt_tokens": None, "prefill_tokens": None,
                "prefix_hits_per_server": None}
    deltas = [a - b for a, b in zip(after, before)]  # type: ignore[operator]
    total = sum(deltas, PrefixCounters())
    return {
        "prefix_cache_queries": int(total.queries), "prefix_cache_hits": int(total.hits),
        "prefix_hit_rate": total.hits / total.queries if total.queries > 0 else None,
        "server_prompt_tokens": int(total.prompt_tokens),
        "prefill_tokens": int(max(0.0, total.prompt_tokens - total.hits)),
        "prefix_hits_per_server": [int(d.hits) for d in deltas],
    }
