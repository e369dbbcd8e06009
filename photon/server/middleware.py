"""Pure ASGI middleware: API-key auth and the request-body size limit."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from photon.server.errors import error_body

PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


async def _send_json(send: Send, status: int, body: dict[str, Any],
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    import json

    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches (constant-time), except PUBLIC_PATHS
    and CORS preflight requests."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS \
                or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"")
        given = auth[7:] if auth[:7].lower() == b"bearer " else b""
        if not hmac.compare_digest(given, self._key):
            await _send_json(send, 401, error_body(401, "invalid or missing API key", None,
                                                   "invalid_api_key"),
                             [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for request bodies over `limit` bytes (by Content-Length, or while reading)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await _send_json(send, 413, error_body(
                413, f"request body larger than {self.limit} bytes", None, "request_too_large"))
            return
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, f"request body larger than {self.limit} bytes")
            return message

        await self.app(scope, limited, send)
