"""Test helpers for `photon router`: an encoder of vLLM's KV event layout, a replay server, fake
backends and a live router, all on loopback ports chosen at run time."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from photon.router.app import build_router_app
from photon.router.router import Router, RouterConfig, RouterParts
from photon.router.subscriber import EventSubscriber
from tests.server_util import LiveServer, serve_app, wait_until


# ---- vLLM's KV event layout, declared as vLLM declares it (vllm/distributed/kv_events.py) -------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encode(events: list[Any], ts: float = 1.5, rank: int | None = None) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=rank))


def stored(hashes: list[int], tokens: list[int] | None = None, parent: int | None = None,
           block_size: int = 4) -> BlockStored:
    tokens = tokens if tokens is not None else list(range(block_size * len(hashes)))
    return BlockStored(hashes, parent, tokens, block_size, None, "GPU")


# ---- a replay server: vLLM's ROUTER replay socket over a fixed buffer ----------------------------
@contextmanager
def replay_server(buffer: dict[int, bytes]) -> Iterator[str]:
    """Serves `(seq, payload)` for every buffered seq >= the requested one, then the end marker
    (seq -1, empty payload); yields the endpoint."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def serve_one() -> None:
        if not sock.poll(20):
            return
        client, _, start = sock.recv_multipart()
        first = int.from_bytes(start, "big")
        for seq in sorted(s for s in buffer if s >= first):
            sock.send_multipart([client, b"", seq.to_bytes(8, "big"), buffer[seq]])
        sock.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    try:
        with serving_thread(serve_one):
            yield f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(linger=0)


@contextmanager
def serving_thread(serve_one: Callable[[], None]) -> Iterator[None]:
    """Call `serve_one` (which waits briefly for work) in a thread until the block exits."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            serve_one()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


class Publisher:
    """A PUB socket on a loopback port, with vLLM's (topic, seq, payload) frames."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.seq = 0

    def publish(self, payload: bytes) -> bool:
        self.sock.send_multipart([b"kv-events", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1
        return False

    def until_heard(self, sub: EventSubscriber) -> None:
        """A SUB socket misses what is published before it has connected: publish empty
        batches until one arrives."""
        wait_until(lambda: sub.stats.batches > 0 or self.publish(encode([])), "subscribed")


# ---- fake backends ---------------------------------------------------------------------------
@dataclass
class FakeBackend:
    name: str
    healthy: bool = True
    running: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    streams_closed: int = 0  # streams that ended (finished, broken or abandoned)


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def fake_backend_app(fake: FakeBackend) -> FastAPI:
    """/health, /metrics, /v1/models, /tokenize, and completions that answer with the backend's
    name: JSON, or 3 SSE chunks and [DONE] (`"break": true` breaks the stream after one)."""
    app = FastAPI()
    app.state.engine = None  # serve_app reads these
    app.state.serving = SimpleNamespace(admission=None)

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"} if fake.healthy else JSONResponse({}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(f'photon:num_requests_running{{model_name="m"}} {fake.running}\n'
                                 f'photon:num_requests_waiting{{model_name="m"}} 0\n')

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": fake.name}]}

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Any:
        body = await raw.json()
        return {"tokens": [ord(c) for c in body.get("prompt") or ""]}

    async def complete(raw: Request) -> Any:
        body = await raw.json()
        fake.bodies.append(body)
        if not body.get("stream"):
            return {"backend": fake.name, "auth": raw.headers.get("authorization")}
        return StreamingResponse(_chunks(fake, body), media_type="text/event-stream")

    app.add_api_route("/v1/completions", complete, methods=["POST"])
    app.add_api_route("/v1/chat/completions", complete, methods=["POST"])
    return app


async def _chunks(fake: FakeBackend, body: dict[str, Any]) -> AsyncIterator[bytes]:
    """3 chunks and [DONE]; `"break": true`: an error after the first; `"endless": true`: a
    chunk every few milliseconds until the client goes away."""
    try:
        i = 0
        while i < 3 or body.get("endless"):
            yield sse({"backend": fake.name, "i": i})
            if body.get("break"):
                raise RuntimeError("the backend died mid-stream")
            i += 1
            await asyncio.sleep(0.005 if body.get("endless") else 0)
        yield b"data: [DONE]\n\n"
    finally:
        fake.streams_closed += 1


@contextmanager
def fake_backends(*names: str) -> Iterator[list[tuple[FakeBackend, LiveServer]]]:
    fakes = [FakeBackend(n) for n in names]
    with ExitStack() as stack:
        yield [(f, stack.enter_context(serve_app(fake_backend_app(f)))) for f in fakes]


@contextmanager
def dropping_server() -> Iterator[str]:
    """A TCP server that accepts and at once closes every connection (a backend that dies
    before its first byte); yields its base URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.05)

    def serve_one() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.recv(65536)
        conn.close()

    try:
        with serving_thread(serve_one):
            yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def letter_tokenizer() -> Any:
    """A PromptTokenizer that maps each character of a completions prompt to its code point."""
    class Letters:
        async def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
            prompt = body.get("prompt")
            return [ord(c) for c in prompt] if isinstance(prompt, str) else None
    return Letters()


@contextmanager
def live_router(config: RouterConfig, parts: RouterParts | None = None
                ) -> Iterator[tuple[Router, str]]:
    router = Router(config, parts)
    app = build_router_app(router)
    app.state.engine = None
    app.state.serving = SimpleNamespace(admission=None)
    with serve_app(app) as live:
        yield router, live.base_url
