"""The router in front of two real photon servers that publish KV cache events: with
`prefix_aware`, the requests of a conversation group land on the server that already holds the
group's prefix, as the servers' own prefix-cache counters show; the router's hashes of the
prompts equal the ones the servers publish."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx

from photon.engine.block_hash import block_hashes
from photon.router.router import Router, RouterConfig
from tests.router_util import live_router
from tests.server_util import LiveServer, live_server, wait_until
from tests.test_bench_router_tool import _tool

BLOCK = 16


@contextmanager
def _servers(n: int) -> Iterator[list[tuple[LiveServer, str]]]:
    with ExitStack() as stack:
        out = []
        for _ in range(n):
            port = _tool().free_port(pair=True)  # events at port, replay at port + 1
            # A wildcard host binds (a named host would connect, as in vLLM).
            events = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{port + 1}"}
            live = stack.enter_context(live_server(
                {"model": "photon-tiny", "block_size": BLOCK, "kv_events_config": events},
                api_servers=1))
            out.append((live, f"tcp://127.0.0.1:{port}"))
        yield out


def _prefix_hits(live: LiveServer) -> float:
    text = httpx.get(live.base_url + "/metrics", timeout=30).text
    m = re.search(r"^photon:prefix_cache_hits_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _system(i: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    return " ".join(f"{words[(i + j) % 8]}{j}" for j in range(60)) + "\n"


def _hashes(url: str, prompt: str) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"model": "photon-tiny", "prompt": prompt}, timeout=30)
    return block_hashes(r.json()["tokens"], BLOCK)


def _holder(router: Router, hashes: list[int]) -> str | None:
    """The backend whose indexed blocks hold the prompt's first block."""
    held = [u for u in router.pool.urls() if hashes[0] in router.index.blocks_of(u)]
    return held[0] if len(held) == 1 else None


def test_prefix_aware_routes_each_group_to_the_server_holding_its_prefix() -> None:
    with _servers(2) as servers:
        urls = [live.base_url for live, _ in servers]
        config = RouterConfig(backends=tuple(urls), kv_events=tuple(e for _, e in servers),
                              policy="prefix_aware", block_size=BLOCK, scrape_metrics=False)
        with live_router(config) as (router, url):
            wait_until(lambda: len(router.pool.healthy()) == 2, "both backends healthy")
            holder: dict[int, str] = {}
            for g in range(4):  # the opening turn of each group, one after the other
                prompt = _system(g) + "user: hi"
                body = {"model": "photon-tiny", "prompt": prompt, "max_tokens": 4,
                        "temperature": 0}
                assert httpx.post(url + "/v1/completions", json=body, timeout=60).is_success
                hashes = _hashes(urls[0], prompt)
                wait_until(lambda h=hashes: _holder(router, h) is not None, "prefix indexed")
                holder[g] = _holder(router, hashes)
            before = [_prefix_hits(live) for live, _ in servers]
            shared = {}
            for g in range(4):
                for turn in range(2):
                    prompt = _system(g) + f"user: turn {turn} of group {g}"
                    body = {"model": "photon-tiny", "prompt": prompt, "max_tokens": 4,
                            "temperature": 0}
                    assert httpx.post(url + "/v1/completions", json=body, timeout=60).is_success
                    opening = _hashes(urls[0], _system(g) + "user: hi")
                    mine = _hashes(urls[0], prompt)
                    shared[g] = next(i for i, (a, b) in enumerate(zip([*opening, None], mine))
                                     if a != b)
            gained = [_prefix_hits(live) - b for (live, _), b in zip(servers, before)]
            mismatches = sum(s.stats.hash_mismatches for s in router.subscribers.values())
            # POST /reset_prefix_cache (vLLM's) empties a server's cache: its AllBlocksCleared
            # event empties the router's index of it.
            for u in urls:
                assert httpx.post(u + "/reset_prefix_cache", timeout=30).status_code == 200
            wait_until(lambda: router.index.num_blocks() == 0, "index emptied by the resets")
    assert mismatches == 0  # the router hashes prompts as the servers do
    assert set(holder.values()) == set(urls)  # the least-load tie-break spread the groups
    # Each follow-up was sent where its group's blocks were: every shared block is a hit there.
    for i in range(len(urls)):
        expected = sum(2 * shared[g] * BLOCK for g in range(4) if holder[g] == urls[i])
        assert gained[i] >= expected > 0
