"""Fake prefill / decode instances for `photon proxy` tests: the OpenAI endpoints, recording
each request (path, JSON body, headers), with answers a test can set."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

SSE_CHUNKS = [b'data: {"choices":[{"index":0,"text":"a"}]}\n\n',
              b'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}]}\n\n',
              b"data: [DONE]\n\n"]
TRANSFER = {"do_remote_prefill": True, "remote_request_id": "prefill-1",
            "remote_block_ids": [4, 5]}


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakeBackend:
    name: str  # "prefill..." (answers with kv_transfer_params) or "decode..."
    seen: list[Seen] = field(default_factory=list)
    answer: tuple[int, bytes, dict[str, str]] | None = None  # (status, body, headers) to give
    break_stream: bool = False  # end a stream after its first chunk without finishing it
    hang: asyncio.Event | None = None  # answer only once set
    healthy: bool = True
    params: dict[str, Any] | None = None  # a prefill instance's kv_transfer_params (TRANSFER)

    def app(self) -> FastAPI:
        app = FastAPI()

        async def complete(raw: Request) -> Response:
            body = await raw.json()
            self.seen.append(Seen(raw.url.path, body, dict(raw.headers)))
            if self.hang is not None:
                await self.hang.wait()
            if self.answer is not None:
                status, content, headers = self.answer
                return Response(content, status_code=status, headers=headers)
            if body.get("stream"):
                return StreamingResponse(self._stream(), media_type="text/event-stream")
            out: dict[str, Any] = {"id": f"{self.name}-1", "choices": [{"index": 0,
                                                                        "text": self.name}]}
            if self.name.startswith("prefill"):
                out["kv_transfer_params"] = TRANSFER if self.params is None else self.params
            return JSONResponse(out)

        for path in ("/v1/completions", "/v1/chat/completions"):
            app.add_api_route(path, complete, methods=["POST"])

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models(raw: Request) -> dict[str, Any]:
            self.seen.append(Seen(raw.url.path, {}, dict(raw.headers)))
            return {"object": "list", "data": [{"id": self.name, "object": "model"}]}

        return app

    async def _stream(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(SSE_CHUNKS):
            if self.break_stream and i == 1:
                yield chunk[:10]  # half an event, then the connection drops
                raise RuntimeError("the backend died mid-stream")
            yield chunk


def closed_port_url() -> str:
    """The URL of a loopback port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
