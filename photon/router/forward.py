"""Forwarding one request to a backend: the body passes through unchanged, the response too
(JSON, or Server-Sent Events chunk by chunk).

A request is committed to a backend once its first response byte has arrived: until then a
failure (connection refused, a timeout, the connection dropped, a 503) is retried once on
another backend; after that the client gets what the backend sent, and a stream the backend
breaks ends with an OpenAI error event and `data: [DONE]`. Non-streaming responses are read
whole before anything is sent, so they are retried on any failure."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse

from photon.router.backends import Backend
from photon.router.events import BlockKey
from photon.router.router import Router
from photon.server.errors import APIError, error_body, error_response

log = logging.getLogger("photon.router")

MAX_ATTEMPTS = 2  # the first backend, then one retry elsewhere
_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
_RESPONSE_HEADERS = ("content-type", "retry-after", "x-request-id", "cache-control")


@dataclass
class Attempt:
    """One try on one backend that failed before a byte reached the client."""
    url: str
    error: str


def _request_headers(headers: Any) -> dict[str, str]:
    return {k: headers[k] for k in _REQUEST_HEADERS if k in headers}


def _response_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: resp.headers[k] for k in _RESPONSE_HEADERS if k in resp.headers}


async def forward(router: Router, path: str, raw: bytes, body: dict[str, Any],
                  headers: Any) -> Response:
    """Send the request to the backend the policy chooses; on a failure before the first
    byte, once more to another one."""
    hashes: list[BlockKey] = await router.prompt_hashes(path, body)
    failed: list[Attempt] = []
    for _ in range(MAX_ATTEMPTS):
        decision = router.choose(hashes, exclude=[a.url for a in failed])
        if decision is None:
            break
        if failed:
            router.metrics.retries.inc()
        result = await _attempt(router, decision.url, path, raw, headers,
                                stream=body.get("stream") is True)
        if isinstance(result, Response):
            return result
        router.not_sent(decision.url, hashes)
        failed.append(result)
    e = no_backend(failed)
    return error_response(e.status, e.message, code=e.code)


def no_backend(failed: list[Attempt], what: str = "backend") -> APIError:
    """The error when every try failed (502), or none could be made (503)."""
    if not failed:
        return APIError(503, f"no healthy {what} to send the request to",
                        code="no_healthy_backend")
    tried = "; ".join(f"{a.url}: {a.error}" for a in failed)
    return APIError(502, f"the request failed on every {what} tried ({tried})",
                    code="backend_failed")


async def _attempt(router: Router, url: str, path: str, raw: bytes, headers: Any,
                   stream: bool) -> Response | Attempt:
    backend = router.pool.get(url)
    assert backend is not None and router.client is not None
    router.metrics.requests.labels(url).inc()
    backend.outstanding += 1
    resp: httpx.Response | None = None
    try:
        req = router.client.build_request("POST", url + path, content=raw,
                                          headers=_request_headers(headers))
        resp = await router.client.send(req, stream=True)
        if resp.status_code == 503:  # its engine is stopped: worth another backend
            raise Unavailable((await resp.aread()).decode("utf-8", "replace")[:200])
        chunks = resp.aiter_raw()
        first = await anext(chunks, b"") if stream else await resp.aread()
    except (httpx.HTTPError, Unavailable) as e:
        await _release(backend, resp)
        return failed_attempt(router, url, e)
    if stream:
        body = _relay(router, backend, resp, first, chunks)
        return StreamingResponse(body, resp.status_code, headers=_response_headers(resp))
    await _release(backend, resp)
    return Response(first, resp.status_code, headers=_response_headers(resp))


async def _release(backend: Backend, resp: httpx.Response | None) -> None:
    """Done with `backend`: close the connection even while the client's task is being
    cancelled (it disconnected), so that the backend sees the disconnect and aborts."""
    backend.outstanding -= 1
    if resp is not None:
        with anyio.CancelScope(shield=True):
            await resp.aclose()


class Unavailable(Exception):
    """The backend answered 503 (its engine is stopped or unavailable)."""


def failed_attempt(router: Router, url: str, e: Exception) -> Attempt:
    """A try that failed before its first byte: counted, and a backend that refused the
    connection or answered 503 is out of rotation until its health check passes."""
    kind = "unavailable" if isinstance(e, Unavailable) else type(e).__name__
    router.metrics.errors.labels(url, kind).inc()
    if isinstance(e, (httpx.ConnectError, Unavailable)):
        router.mark_down(url, f"{kind}: {e}")
    log.info("request to %s failed before its first byte: %s: %s", url, kind, e)
    return Attempt(url, f"{kind}: {e}" if str(e) else kind)


async def _relay(router: Router, backend: Backend, resp: httpx.Response, first: bytes,
                 chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The backend's stream, chunk by chunk; a break ends it with an error event and [DONE]."""
    try:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
    except httpx.HTTPError as e:
        router.metrics.errors.labels(backend.url, "stream_" + type(e).__name__).inc()
        message = f"the backend {backend.url} failed mid-stream: {type(e).__name__}: {e}"
        log.warning(message)
        event = json.dumps(error_body(502, message, code="backend_failed"))
        yield f"\n\ndata: {event}\n\ndata: [DONE]\n\n".encode()
    finally:
        await _release(backend, resp)
