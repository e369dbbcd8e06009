"""Backend probes: `/health` (up or down) and the load gauges of `/metrics` (photon's or vLLM's
`num_requests_running` / `num_requests_waiting`). Every call has a timeout; a probe never raises."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

_PREFIXES = ("photon:", "vllm:")


@dataclass(frozen=True)
class BackendLoad:
    running: float
    waiting: float


async def probe_health(client: httpx.AsyncClient, url: str, timeout_s: float) -> bool:
    try:
        resp = await client.get(f"{url}/health", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200


def parse_load(text: str) -> BackendLoad | None:
    """running / waiting summed over label sets; None when the text has neither gauge."""
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for prefix in _PREFIXES:
                name = family.name.removeprefix(prefix)
                if family.name.startswith(prefix) and name in ("num_requests_running",
                                                               "num_requests_waiting"):
                    found[name] = found.get(name, 0.0) + sum(s.value for s in family.samples)
    except ValueError:
        return None
    if not found:
        return None
    return BackendLoad(found.get("num_requests_running", 0.0),
                       found.get("num_requests_waiting", 0.0))


async def probe_load(client: httpx.AsyncClient, url: str, timeout_s: float) -> BackendLoad | None:
    try:
        resp = await client.get(f"{url}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return parse_load(resp.text) if resp.status_code == 200 else None
