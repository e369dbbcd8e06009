"""Calls to the backends (httpx): a pool's instance by load, failover past one that cannot be
reached, a timeout on every call, and every failure as an OpenAI error with a status a client
can act on: the backend's own error answer as it is; no instance reachable -> 503; silent past
the timeout -> 504; a broken or malformed answer -> 502."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from photon.proxy.config import ProxyConfig
from photon.proxy.metrics import ProxyMetrics
from photon.proxy.pool import Backend, Pool
from photon.server.errors import APIError, error_body


class UpstreamError(Exception):
    """A backend's error answer, passed to the client with its status and body."""

    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status
        self.body = body
        self.headers = headers


@dataclass
class Hop:
    """One open request to a backend; `close()` (idempotent) ends it and its count."""

    pool: Pool
    backend: Backend
    response: httpx.Response
    started: float = field(default_factory=time.monotonic)
    closed: bool = False

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.backend.outstanding -= 1
            await self.response.aclose()

    async def read(self, metrics: ProxyMetrics) -> bytes:
        try:
            return await self.response.aread()
        except httpx.HTTPError as e:
            raise hop_failure(self.pool.name, self.backend.url, e, metrics) from None

    async def json(self, metrics: ProxyMetrics) -> dict[str, Any]:
        content = await self.read(metrics)
        try:
            data = json.loads(content)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            metrics.error(self.pool.name, "invalid")
            raise APIError(502, f"the {self.pool.name} instance {self.backend.url} answered "
                                f"with something other than a JSON object", code="bad_gateway")
        return data


class Upstream:
    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics,
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

    async def open(self, pool_name: str, method: str, path: str, headers: dict[str, str],
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
            hop = Hop(pool, backend, response)
            if response.status_code != 200:
                await self._refuse(hop)
            return hop
        raise APIError(503, f"no {pool_name} instance is reachable: {', '.join(down)}",
                       code="backend_unavailable")

    async def _refuse(self, hop: Hop) -> None:
        """Raise the backend's error answer (an OpenAI error body stays as it is)."""
        try:
            content = await hop.read(self.metrics)
        finally:
            await hop.close()
        self.metrics.error(hop.pool.name, "status")
        status = hop.response.status_code
        try:
            body = json.loads(content)
        except ValueError:
            body = None
        if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
            text = content.decode("utf-8", "replace")[:300]
            body = error_body(status, f"the {hop.pool.name} instance {hop.backend.url} "
                                      f"answered {status}: {text}", code="backend_error")
        retry = hop.response.headers.get("retry-after")
        raise UpstreamError(status, body, {"Retry-After": retry} if retry else {})

    async def health(self, url: str) -> str:
        """"ok", or why the instance at `url` is not."""
        try:
            r = await self.client.get(url + "/health", timeout=self.config.connect_timeout_s)
        except httpx.HTTPError as e:
            return describe(e)
        return "ok" if r.status_code == 200 else f"answered {r.status_code}"


def describe(e: httpx.HTTPError) -> str:
    if isinstance(e, httpx.TimeoutException):
        return f"timed out ({type(e).__name__})"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def hop_failure(pool: str, url: str, e: httpx.HTTPError, metrics: ProxyMetrics) -> APIError:
    """The error for a hop that failed after its connection was made."""
    if isinstance(e, httpx.TimeoutException):
        metrics.error(pool, "timeout")
        return APIError(504, f"the {pool} instance {url} did not answer in time: {describe(e)}",
                        code="backend_timeout")
    metrics.error(pool, "stream")
    return APIError(502, f"the {pool} instance {url} failed: {describe(e)}", code="bad_gateway")
