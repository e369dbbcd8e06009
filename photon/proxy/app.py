"""The proxy's FastAPI app: `build_proxy_app(config)`. State hangs off `app.state` (`upstream`:
the backends and their httpx client, `metrics`); no globals.

/v1/completions and /v1/chat/completions go in two hops (photon/proxy/hops.py: vLLM's
disaggregated-serving protocol), to the least loaded instance of each pool."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from photon import __version__
from photon.proxy.config import ProxyConfig
from photon.proxy.hops import forward_headers, install_upstream_handler, read_object, relay, whole
from photon.proxy.metrics import ProxyMetrics
from photon.proxy.upstream import Upstream
from photon.server.errors import error_body, install_handlers
from photon.server.middleware import BodyLimitMiddleware

MAX_BODY_BYTES = 16 * 1024 * 1024


def build_proxy_app(config: ProxyConfig,
                    transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """`transport`: httpx's transport to the backends (tests pass a MockTransport)."""
    metrics = ProxyMetrics()
    upstream = Upstream(config, metrics, transport)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await upstream.aclose()

    app = FastAPI(title="photon proxy", version=__version__, lifespan=lifespan)
    app.state.upstream, app.state.metrics = upstream, metrics
    install_handlers(app)
    install_upstream_handler(app)
    app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES)
    _add_routes(app, upstream, metrics)
    return app


def _add_routes(app: FastAPI, upstream: Upstream, metrics: ProxyMetrics) -> None:
    async def two_hops(raw: Request) -> Response:
        body = await read_object(raw)
        path = raw.url.path
        metrics.requests.labels(path).inc()
        chat = path.endswith("/chat/completions")
        return await relay(raw, upstream, metrics, path, body, chat)

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, two_hops, methods=["POST"])

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        hop = await upstream.open("decode", "GET", "/v1/models", forward_headers(raw))
        return await whole(hop, metrics)

    @app.get("/health")
    async def health() -> JSONResponse:
        return await pools_health(upstream)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def pools_health(upstream: Upstream) -> JSONResponse:
    """200 when each pool has an instance whose /health is ok, else 503 naming what is down;
    either way each instance's state by pool."""
    named = [(pool.name, b.url) for pool in upstream.pools.values() for b in pool.backends]
    states = await asyncio.gather(*(upstream.health(url) for _, url in named))
    detail: dict[str, dict[str, str]] = {}
    for (name, url), state in zip(named, states):
        detail.setdefault(name, {})[url] = state
    down = [f"{name}: every instance ({'; '.join(f'{u}: {s}' for u, s in urls.items())})"
            for name, urls in detail.items() if "ok" not in urls.values()]
    if not down:
        return JSONResponse({"status": "ok", **detail})
    body = error_body(503, "down: " + " | ".join(down), code="backend_unavailable")
    return JSONResponse({**body, **detail}, status_code=503)
