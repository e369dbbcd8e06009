"""Speculative decoding's counters of a server's /metrics, for `photon bench serve`.

The run's mean acceptance length and per-position acceptance come from the server's counters
read before and after it: `PREFIX:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens` and `..._num_accepted_tokens_per_pos{position}` (photon's `photon:`
names and vLLM's `vllm:` ones; series of every label set are summed). A server without them
(no speculation, or no /metrics) gives no speculative fields (None).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from photon.spec.stats import SpecDecodingStats, acceptance_summary

_SAMPLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*:spec_decode_(num_drafts|num_draft_tokens|"
                     r"num_accepted_tokens|num_accepted_tokens_per_pos)(?:_total)?"
                     r"(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_POSITION = re.compile(r'position="(\d+)"')


def parse_spec_counters(text: str) -> SpecDecodingStats | None:
    """The speculative counters in a Prometheus text exposition; None when it has none."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, value = m.group(1), float(m.group("value"))
        if name == "num_accepted_tokens_per_pos":
            pos = _POSITION.search(m.group("labels") or "")
            if pos is not None:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        else:
            totals[name] = totals.get(name, 0.0) + value
    if "num_drafts" not in totals:
        return None
    positions = [int(per_pos.get(j, 0.0)) for j in range(max(per_pos, default=-1) + 1)]
    return SpecDecodingStats(int(totals["num_drafts"]), int(totals.get("num_draft_tokens", 0)),
                             int(totals.get("num_accepted_tokens", 0)), positions)


def _padded(stats: SpecDecodingStats, positions: int) -> SpecDecodingStats:
    per_pos = stats.num_accepted_tokens_per_pos
    return SpecDecodingStats(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                             per_pos + [0] * (positions - len(per_pos)))


def spec_delta_fields(before: SpecDecodingStats | None,
                      after: SpecDecodingStats | None) -> dict[str, Any]:
    """The run's speculative fields (photon.spec.stats.acceptance_summary) from the counters
    before and after it; all None unless both reads had them."""
    if before is None or after is None:
        return acceptance_summary(None)
    n = max(len(before.num_accepted_tokens_per_pos), len(after.num_accepted_tokens_per_pos))
    return acceptance_summary(_padded(after, n).since(_padded(before, n)))


async def fetch_settled_spec_counters(cfg: Any, interval_s: float = 0.1,
                                      tries: int = 30) -> SpecDecodingStats | None:
    """The counters once two reads `interval_s` apart agree (at most `tries` reads). A run's
    last responses can end before the server commits the steps still in flight for them (rows
    of finished requests, whose drafts it counts too); read at once, those counts would land in
    the next run's window."""
    last = await fetch_spec_counters(cfg)
    for _ in range(tries - 1):
        if last is None:
            return None
        await asyncio.sleep(interval_s)
        now = await fetch_spec_counters(cfg)
        if now == last:
            return now
        last = now
    return last


async def fetch_spec_counters(cfg: Any) -> SpecDecodingStats | None:
    """The server's speculative counters (GET /metrics), or None when it has none or fails."""
    from photon.bench.serve_client import make_session

    try:
        async with make_session(cfg, 1) as session:
            url = cfg.base_url.rstrip("/") + "/metrics"
            async with session.get(url, headers=cfg.headers()) as resp:
                if resp.status != 200:
                    return None
                return parse_spec_counters(await resp.text())
    except Exception:  # noqa: BLE001 - metrics are optional: a server may not expose them
        return None
