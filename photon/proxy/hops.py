"""The two-hop prefill/decode protocol (vLLM's disaggregated serving), shared by `photon proxy`
and `photon router --prefill ... --decode ...`. Each front says how it opens a hop to an
instance of a role (a `HopOpener`: the proxy by least load, the router by its policy); the rest
is here:
1. to a prefill instance: the request with max_tokens=1 (and max_completion_tokens=1), not
   streamed, and kv_transfer_params {"do_remote_decode": true}; its response's
   kv_transfer_params say where the prompt's KV cache waits;
2. to a decode instance: the client's request with those kv_transfer_params; its answer (JSON,
   or the Server-Sent Events as they come) goes to the client unchanged.
A request that moves more than one sequence (several prompts, n > 1) goes to a decode instance
whole: kv_transfer_params move one sequence's KV cache.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram

from photon.server.errors import APIError, bad_request, error_body
from photon.server.openai_serving import unless_disconnected
from photon.server.protocol import sse_event

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
PREFILL_PARAMS = {"do_remote_decode": True}
_FORWARDED_HEADERS = ("authorization", "x-request-id")
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
            160.0, 640.0)


class HopMetrics:
    """Failed hops `{prefix}{errors_name}{label, reason}` (reason: `unreachable`, `timeout`,
    `status`, `stream`, `invalid`, `no_params`) and the histograms `{prefix}prefill_seconds`,
    `{prefix}decode_seconds`, in the front's registry."""

    def __init__(self, registry: CollectorRegistry, prefix: str, errors_name: str,
                 label: str) -> None:
        self.errors = Counter(f"{prefix}{errors_name}", f"Failed hops by {label} and reason.",
                              [label, "reason"], registry=registry)
        self.hop_seconds = {
            role: Histogram(f"{prefix}{role}_seconds", f"Time in the {role} hop.",
                            buckets=_BUCKETS, registry=registry)
            for role in ROLES}

    def error(self, role: str, reason: str) -> None:
        self.errors.labels(role, reason).inc()


class HopBackend(Protocol):
    url: str
    outstanding: int  # requests sent to it and not yet answered in full


class UpstreamError(Exception):
    """A backend's error answer, passed to the client with its status and body."""

    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status
        self.body = body
        self.headers = headers


def install_upstream_handler(app: FastAPI) -> None:
    @app.exception_handler(UpstreamError)
    async def _upstream(_: Request, exc: UpstreamError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)


@dataclass
class Hop:
    """One open request to a backend (its answer's headers read); `close()` (idempotent) ends
    it and the backend's count."""

    role: str
    backend: HopBackend
    response: httpx.Response
    started: float = field(default_factory=time.monotonic)
    closed: bool = False

    async def close(self) -> None:
        """Closes even while the caller is being cancelled (its client went away), so that the
        backend sees the disconnect and aborts."""
        if not self.closed:
            self.closed = True
            self.backend.outstanding -= 1
            with anyio.CancelScope(shield=True):
                await self.response.aclose()

    async def read(self, metrics: HopMetrics) -> bytes:
        try:
            return await self.response.aread()
        except httpx.HTTPError as e:
            raise hop_failure(self.role, self.backend.url, e, metrics) from None

    async def json(self, metrics: HopMetrics) -> dict[str, Any]:
        content = await self.read(metrics)
        try:
            data = json.loads(content)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            metrics.error(self.role, "invalid")
            raise APIError(502, f"the {self.role} instance {self.backend.url} answered "
                                f"with something other than a JSON object", code="bad_gateway")
        return data


class HopOpener(Protocol):
    async def open(self, role: Role, method: str, path: str, headers: dict[str, str],
                   body: dict[str, Any] | None = None) -> Hop:
        """A hop to an instance of `role` whose answer is 200 (else UpstreamError or APIError)."""
        ...


async def refuse(hop: Hop, metrics: HopMetrics) -> UpstreamError:
    """The backend's error answer as an UpstreamError (an OpenAI error body stays as it is);
    the hop is closed."""
    try:
        content = await hop.read(metrics)
    finally:
        await hop.close()
    metrics.error(hop.role, "status")
    status = hop.response.status_code
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        text = content.decode("utf-8", "replace")[:300]
        body = error_body(status, f"the {hop.role} instance {hop.backend.url} "
                                  f"answered {status}: {text}", code="backend_error")
    retry = hop.response.headers.get("retry-after")
    return UpstreamError(status, body, {"Retry-After": retry} if retry else {})


def describe(e: httpx.HTTPError) -> str:
    if isinstance(e, httpx.TimeoutException):
        return f"timed out ({type(e).__name__})"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def hop_failure(role: str, url: str, e: httpx.HTTPError, metrics: HopMetrics) -> APIError:
    """The error for a hop that failed after its connection was made."""
    if isinstance(e, httpx.TimeoutException):
        metrics.error(role, "timeout")
        return APIError(504, f"the {role} instance {url} did not answer in time: {describe(e)}",
                        code="backend_timeout")
    metrics.error(role, "stream")
    return APIError(502, f"the {role} instance {url} failed: {describe(e)}", code="bad_gateway")


# ---- the protocol ----------------------------------------------------------------------------
async def relay(raw: Request, opener: HopOpener, metrics: HopMetrics, path: str,
                body: dict[str, Any], chat: bool) -> Response:
    """The two hops for the client request `raw` (its JSON object `body`); 499 when the client
    went away first (the open hop is closed: its instance sees the disconnect)."""
    headers = forward_headers(raw)
    response = await unless_disconnected(raw, run(opener, metrics, path, body, headers, chat))
    return Response(status_code=499) if response is None else response


async def run(opener: HopOpener, metrics: HopMetrics, path: str, body: dict[str, Any],
              headers: dict[str, str], chat: bool) -> Response:
    decode = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if num_sequences(body, chat) == 1:
        params = await prefill(opener, metrics, path, prefill_body(body, chat), headers)
        if params is not None:
            decode["kv_transfer_params"] = params
    hop = await opener.open("decode", "POST", path, headers, decode)
    if body.get("stream") is True:
        return PassthroughStream(hop, metrics)
    return await whole(hop, metrics)


async def prefill(opener: HopOpener, metrics: HopMetrics, path: str, body: dict[str, Any],
                  headers: dict[str, str]) -> dict[str, Any] | None:
    """The prefill hop; the kv_transfer_params its instance returned (None: it returned none,
    as an instance without a KV connector does; the decode instance then computes the prompt
    itself)."""
    hop = await opener.open("prefill", "POST", path, headers, body)
    try:
        data = await hop.json(metrics)
    finally:
        await hop.close()
        metrics.hop_seconds["prefill"].observe(time.monotonic() - hop.started)
    params = data.get("kv_transfer_params")
    if params is None:
        metrics.error("prefill", "no_params")
    elif not isinstance(params, dict):
        metrics.error("prefill", "invalid")
        raise APIError(502, f"the prefill instance {hop.backend.url} returned "
                            f"kv_transfer_params that are not a JSON object", code="bad_gateway")
    return params


def num_sequences(body: dict[str, Any], chat: bool) -> int:
    """How many sequences the request asks for (prompts x n), as far as the front can tell;
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


async def whole(hop: Hop, metrics: HopMetrics) -> Response:
    """A hop's full answer, passed on as it is."""
    try:
        content = await hop.read(metrics)
    finally:
        await hop.close()
        if hop.role == "decode":
            metrics.hop_seconds["decode"].observe(time.monotonic() - hop.started)
    return Response(content, status_code=hop.response.status_code,
                    media_type=hop.response.headers.get("content-type", "application/json"))


class PassthroughStream(StreamingResponse):
    """The decode instance's Server-Sent Events as they come. A stream broken off ends with an
    error event and [DONE], as a photon server's own stream does; the hop is closed however the
    response ends (a client gone: the decode instance sees the disconnect and aborts)."""

    def __init__(self, hop: Hop, metrics: HopMetrics) -> None:
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
