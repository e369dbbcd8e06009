"""A bounded load test: 200 concurrent streaming requests, some dropped mid-stream."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from tests.server_util import LiveServer, live_server, wait_drained, wait_until

NUM_REQUESTS = 200


async def _one(client: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    body = {"prompt": f"request {rng.randrange(1000)} says", "max_tokens": rng.randint(4, 12),
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "temperature": rng.choice([0.0, 1.0])}
    drop_after = rng.randint(1, 4) if rng.random() < 0.3 else None
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        n = 0
        usage = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            n += 1
            if drop_after is not None and n >= drop_after:
                return "dropped"  # leaving the block closes the connection mid-stream
            data = line[6:]
            if data == "[DONE]":
                break
            usage = json.loads(data).get("usage") or usage
    assert usage is not None and usage["completion_tokens"] == body["max_tokens"]
    return "done"


async def _load(server: LiveServer) -> list[str]:
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 10)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        url = server.api_url + "/completions"
        return await asyncio.gather(*(_one(client, url, random.Random(rng.random()))
                                      for _ in range(NUM_REQUESTS)))


def test_concurrent_streams_with_disconnects() -> None:
    with live_server({"max_num_seqs": 64}) as server:
        results = asyncio.run(_load(server))
        assert results.count("done") + results.count("dropped") == NUM_REQUESTS
        assert results.count("dropped") > 0
        assert httpx.get(server.base_url + "/health").status_code == 200
        wait_drained(server.engine)
        admission = server.admission
        wait_until(lambda: admission.in_flight == 0, "every admitted sequence is released")
