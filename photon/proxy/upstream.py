"""Calls to the backends (httpx): a pool's instance by load, failover past one that cannot be
reached, a timeout on every call, and every failure as an OpenAI error with a status a client
can act on: the backend's own error answer as it is; no instance reachable -> 503; silent past
the timeout -> 504; a broken or malformed answer -> 502."""

from __future__ import annotations

from typing import Any

import httpx

from photon.proxy.config import ProxyConfig
from photon.proxy.hops import Hop, HopMetrics, Role, describe, hop_failure, refuse
from photon.proxy.pool import Pool
from photon.server.errors import APIError


class Upstream:
    def __init__(self, config: ProxyConfig, metrics: HopMetrics,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.pools = {"prefill": Pool("prefill", config.prefill),
                      "decode": Pool("decode", config.decode)}
        self.client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def aclose(self) -> None:
        await self.client.aclose()

    async def open(self, pool_name: Role, method: str, path: str, headers: dict[str, str],
                   body: dict[str, Any] | None = None) -> Hop:
        """A hop to the pool's least loaded instance that can be reached, its answer's headers
        read (status 200; anything else raises UpstreamError)."""
        pool = self.pools[pool_name]
        down: list[str] = []
        for backend in pool.order():
            request = self.client.build_request(method, backend.url + path, json=body,
                                                headers=headers)
            backend.outstanding += 1
            try:
                response = await self.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                backend.outstanding -= 1
                self.metrics.error(pool_name, "unreachable")
                down.append(f"{backend.url} ({describe(e)})")
                continue
            except BaseException as e:
                backend.outstanding -= 1
                if isinstance(e, httpx.HTTPError):
                    raise hop_failure(pool_name, backend.url, e, self.metrics) from None
                raise
            hop = Hop(pool_name, backend, response)
            if response.status_code != 200:
                raise await refuse(hop, self.metrics)
            return hop
        raise APIError(503, f"no {pool_name} instance is reachable: {', '.join(down)}",
                       code="backend_unavailable")

    async def health(self, url: str) -> str:
        """"ok", or why the instance at `url` is not."""
        try:
            r = await self.client.get(url + "/health", timeout=self.config.connect_timeout_s)
        except httpx.HTTPError as e:
            return describe(e)
        return "ok" if r.status_code == 200 else f"answered {r.status_code}"
