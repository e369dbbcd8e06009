"""The router's FastAPI app: OpenAI's endpoints in front of the backends, /health, /metrics.

`build_router_app(router)`: the app starts the router (HTTP client, event subscribers, health
checks) in its lifespan and stops it on the way out. The router adds no API key of its own: the
Authorization header reaches the backends, which check it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from photon import __version__
from photon.proxy.hops import install_upstream_handler
from photon.router.forward import forward
from photon.router.pd import forward_two_hops
from photon.router.router import Router
from photon.server.errors import error_response, install_handlers
from photon.server.middleware import BodyLimitMiddleware

DEFAULT_MAX_BODY = 16 * 1024 * 1024


def build_router_app(router: Router, max_body_bytes: int = DEFAULT_MAX_BODY) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="photon router", version=__version__, lifespan=lifespan)
    app.state.router = router
    install_handlers(app)
    install_upstream_handler(app)
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    _add_openai_routes(app, router)
    _add_utility_routes(app, router)
    return app


async def _json_body(raw: Request) -> tuple[bytes, dict[str, Any] | Response]:
    data = await raw.body()
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        return data, error_response(400, f"the request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        return data, error_response(400, "the request body must be a JSON object")
    return data, body


def _add_openai_routes(app: FastAPI, router: Router) -> None:
    async def proxy(raw: Request) -> Response:
        data, body = await _json_body(raw)
        if isinstance(body, Response):
            return body
        if router.disaggregated:
            return await forward_two_hops(router, raw, raw.url.path, body)
        return await forward(router, raw.url.path, data, body, raw.headers)

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, proxy, methods=["POST"])

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await _first_answer(router, "/v1/models", raw.headers.get("authorization"))


async def _first_answer(router: Router, path: str, auth: str | None) -> Response:
    """GET `path` from the healthy backends in turn; the first answer is the router's."""
    assert router.client is not None
    headers = {"authorization": auth} if auth else {}
    for backend in router.pool.healthy():
        try:
            resp = await router.client.get(backend.url + path, headers=headers,
                                           timeout=router.config.connect_timeout_s)
        except httpx.HTTPError:
            continue
        return Response(resp.content, resp.status_code,
                        media_type=resp.headers.get("content-type"))
    return error_response(503, "no healthy backend to answer", code="no_healthy_backend")


def _add_utility_routes(app: FastAPI, router: Router) -> None:
    @app.get("/health")
    async def health() -> Any:
        """200 while a backend (disaggregated: an instance of each role) is up."""
        pools = {"prefill": router.pool, "decode": router.decode_pool} \
            if router.disaggregated else {"backends": router.pool}
        states = {name: {b.url: "up" if b.healthy else "down" for b in pool}
                  for name, pool in pools.items()}
        down = [name for name, urls in states.items() if "up" not in urls.values()]
        if down:
            what = " or ".join("backend" if n == "backends" else f"{n} instance" for n in down)
            return error_response(503, f"no healthy {what}: {states}",
                                  code="no_healthy_backend")
        return {"status": "ok", "policy": router.policy.name, **states}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(router.refresh_metrics),
                        media_type=CONTENT_TYPE_LATEST)
