"""The proxy's FastAPI app: `build_proxy_app(config)`. State hangs off `app.state` (`upstream`:
the backends and their httpx client, `metrics`); no globals.

/v1/completions and /v1/chat/completions go in two hops (vLLM's disaggregated-serving protocol):
1. to a prefill instance: the request with max_tokens=1 (and max_completion_tokens=1), not
   streamed, and kv_transfer_params {"do_remote_decode": true}; its response's
   kv_transfer_params say where the prompt's KV cache waits;
2. to a decode instance: the client's request with those kv_transfer_params; its answer (JSON,
   or the Server-Sent Events as they come) goes to the client unchanged.
A request that moves more than one sequence (several prompts, n > 1) goes to a decode instance
whole: kv_transfer_params move one sequence's KV cache.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from photon import __version__
from photon.proxy.config import ProxyConfig
from photon.proxy.metrics import ProxyMetrics
from photon.proxy.upstream import Hop, Upstream, UpstreamError, hop_failure
from photon.server.errors import APIError, bad_request, error_body, install_handlers
from photon.server.middleware import BodyLimitMiddleware
from photon.server.openai_serving import unless_disconnected
from photon.server.protocol import sse_event

MAX_BODY_BYTES = 16 * 1024 * 1024
_FORWARDED_HEADERS = ("authorization", "x-request-id")
PREFILL_PARAMS = {"do_remote_decode": True}


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

    @app.exception_handler(UpstreamError)
    async def _upstream(_: Request, exc: UpstreamError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES)
    _add_routes(app, TwoHops(upstream, metrics))
    return app


def _add_routes(app: FastAPI, hops: TwoHops) -> None:
    upstream, metrics = hops.upstream, hops.metrics

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await hops(raw, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await hops(raw, "/v1/chat/completions", chat=True)

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


class TwoHops:
    def __init__(self, upstream: Upstream, metrics: ProxyMetrics) -> None:
        self.upstream = upstream
        self.metrics = metrics

    async def __call__(self, raw: Request, path: str, chat: bool) -> Response:
        body = await read_object(raw)
        self.metrics.requests.labels(path).inc()
        headers = forward_headers(raw)
        response = await unless_disconnected(raw, self._run(path, body, headers, chat))
        return Response(status_code=499) if response is None else response  # 499: client gone

    async def _run(self, path: str, body: dict[str, Any], headers: dict[str, str],
                   chat: bool) -> Response:
        decode = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if num_sequences(body, chat) == 1:
            params = await self._prefill(path, prefill_body(body, chat), headers)
            if params is not None:
                decode["kv_transfer_params"] = params
        hop = await self.upstream.open("decode", "POST", path, headers, decode)
        if body.get("stream") is True:
            return PassthroughStream(hop, self.metrics)
        return await whole(hop, self.metrics)

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]
                       ) -> dict[str, Any] | None:
        """The prefill hop; the kv_transfer_params its instance returned (None: it returned
        none, as an instance without a KV connector does; the decode instance then computes
        the prompt itself)."""
        hop = await self.upstream.open("prefill", "POST", path, headers, body)
        try:
            data = await hop.json(self.metrics)
        finally:
            await hop.close()
            self.metrics.hop_seconds["prefill"].observe(time.monotonic() - hop.started)
        params = data.get("kv_transfer_params")
        if params is None:
            self.metrics.error("prefill", "no_params")
        elif not isinstance(params, dict):
            self.metrics.error("prefill", "invalid")
            raise APIError(502, f"the prefill instance {hop.backend.url} returned "
                                f"kv_transfer_params that are not a JSON object",
                           code="bad_gateway")
        return params


def num_sequences(body: dict[str, Any], chat: bool) -> int:
    """How many sequences the request asks for (prompts x n), as far as the proxy can tell;
    the backends check the request itself."""
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompt = body.get("prompt")
    many = not chat and isinstance(prompt, list) and prompt \
        and not all(isinstance(t, int) for t in prompt)
    return n * (len(prompt) if many else 1)


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill hop's request: one token, not streamed (min_tokens would ask for more)."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    if chat and body.get("max_completion_tokens") is not None:
        out["max_completion_tokens"] = 1
    return out


async def read_object(raw: Request) -> dict[str, Any]:
    try:
        body = json.loads(await raw.body())
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def forward_headers(raw: Request) -> dict[str, str]:
    """The client's Authorization goes to every backend; X-Request-Id (made up if absent)
    names the request in both hops."""
    headers = {k: raw.headers[k] for k in _FORWARDED_HEADERS if k in raw.headers}
    headers.setdefault("x-request-id", uuid.uuid4().hex)
    return headers


async def whole(hop: Hop, metrics: ProxyMetrics) -> Response:
    """A hop's full answer, passed on as it is."""
    try:
        content = await hop.read(metrics)
    finally:
        await hop.close()
        if hop.pool.name == "decode":
            metrics.hop_seconds["decode"].observe(time.monotonic() - hop.started)
    return Response(content, status_code=hop.response.status_code,
                    media_type=hop.response.headers.get("content-type", "application/json"))


class PassthroughStream(StreamingResponse):
    """The decode instance's Server-Sent Events as they come. A stream broken off ends with an
    error event and [DONE], as a photon server's own stream does; the hop is closed however the
    response ends (a client gone: the decode instance sees the disconnect and aborts)."""

    def __init__(self, hop: Hop, metrics: ProxyMetrics) -> None:
        super().__init__(self._relay(), headers={"Cache-Control": "no-cache"},
                         media_type=hop.response.headers.get("content-type",
                                                             "text/event-stream"))
        self.hop = hop
        self.metrics = metrics

    async def _relay(self) -> AsyncIterator[bytes]:
        tail = b"\n\n"
        try:
            async for chunk in self.hop.response.aiter_bytes():
                tail = (tail + chunk)[-2:]
                yield chunk
        except httpx.HTTPError as e:
            err = hop_failure("decode", self.hop.backend.url, e, self.metrics)
            gap = "" if tail == b"\n\n" else "\n\n"  # end an event cut in half first
            body = error_body(err.status, err.message, code=err.code)
            yield (gap + sse_event(body) + sse_event("[DONE]")).encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.hop.close()
            self.metrics.hop_seconds["decode"].observe(time.monotonic() - self.hop.started)


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
