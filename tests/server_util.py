"""A live photon server on a loopback port (uvicorn in a background thread, port 0)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI

from photon.config import EngineConfig
from photon.engine.async_engine import AsyncEngine
from photon.engine.async_llm import AsyncLLM
from photon.engine.engine_core import EngineCore
from photon.engine_args import EngineArgs
from photon.server.admission import Admission
from photon.server.app import build_app
from photon.server.openai_serving import ServerConfig

TINY_ARGS: dict[str, Any] = {"model": "photon-tiny-random", "max_model_len": 256,
                             "max_num_seqs": 32, "seed": 0}


@dataclass
class LiveServer:
    app: FastAPI | None  # None: the API servers run in processes of their own
    base_url: str  # http://127.0.0.1:PORT
    engine: AsyncEngine | AsyncLLM  # with several API servers: the test's own front end
    admission: Admission  # the server's admission count (with several: their shared count)

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"


def in_process_only() -> None:
    """Skip a test that patches or reads the server inside this process: with several API
    servers (PHOTON_TEST_API_SERVERS > 1) they run in processes of their own."""
    if api_server_count() > 1:
        import pytest

        pytest.skip("looks inside the server process (PHOTON_TEST_API_SERVERS > 1: the API "
                    "servers run in processes of their own)")


def openai_client(server: LiveServer, api_key: str = "none") -> Any:
    """The official openai client on `server` (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=server.api_url, api_key=api_key, max_retries=0, timeout=60)


def engine_mode() -> str:
    """Which engine the test servers run: "process" (an engine-core process, what `photon
    serve` runs; the default) or "thread" (the engine loop in a thread of the server), chosen
    with PHOTON_TEST_ENGINE."""
    mode = os.environ.get("PHOTON_TEST_ENGINE", "process")
    assert mode in ("process", "thread"), f"PHOTON_TEST_ENGINE={mode!r}: process or thread"
    return mode


def api_server_count() -> int:
    """How many API server processes the test servers run, chosen with PHOTON_TEST_API_SERVERS
    (default 1: the app in the test process). With N > 1, `live_server` runs what `photon serve
    --api-server-count N` runs (tests/multi_server.py), and so do the `photon serve` processes
    tests start (tests/serve_process.py)."""
    value = os.environ.get("PHOTON_TEST_API_SERVERS", "1")
    assert value.isdigit() and int(value) >= 1, \
        f"PHOTON_TEST_API_SERVERS={value!r}: a number of API servers >= 1"
    assert int(value) == 1 or engine_mode() == "process", \
        "several API servers need PHOTON_TEST_ENGINE=process"
    return int(value)


def make_engine(config: EngineConfig) -> AsyncEngine | AsyncLLM:
    if engine_mode() == "thread":
        return AsyncEngine(EngineCore(config))
    return AsyncLLM(config)


def make_configs(engine_args: dict[str, Any] | None = None, **server: Any
                 ) -> tuple[EngineConfig, ServerConfig]:
    config = EngineArgs(**{**TINY_ARGS, **(engine_args or {})}).create_config()
    return config, ServerConfig(served_model_name=config.model.served_model_name,
                                max_model_len=config.model.max_model_len, **server)


def make_app(engine_args: dict[str, Any] | None = None, **server: Any) -> FastAPI:
    config, scfg = make_configs(engine_args, **server)
    return build_app(make_engine(config), scfg)


@contextmanager
def live_server(engine_args: dict[str, Any] | None = None, send_buffer: int | None = None,
                api_servers: int | None = None, **server: Any) -> Iterator[LiveServer]:
    """`send_buffer`: the connections' kernel send buffer in bytes (default: the system's,
    growing as needed), small to let a slow client hold the server up soon. `api_servers`:
    how many API server processes (default: `api_server_count()`); with one, the app runs in
    this process (`LiveServer.app`), with more they run as `photon serve --api-server-count`
    runs them (`LiveServer.app` is None)."""
    count = api_servers or api_server_count()
    if count > 1:
        from tests.multi_server import multi_live_server

        with multi_live_server(*make_configs(engine_args, **server), count, send_buffer) as live:
            yield live
        return
    app = make_app(engine_args, **server)
    try:
        with serve_app(app, send_buffer) as live:
            yield live
    finally:
        app.state.engine.shutdown()


@contextmanager
def serve_app(app: FastAPI, send_buffer: int | None = None) -> Iterator[LiveServer]:
    """Run `app` with uvicorn on a loopback port; the caller owns (and shuts down) its engine."""
    with serve_asgi(app, send_buffer) as base_url:
        yield LiveServer(app, base_url, app.state.engine, app.state.serving.admission)


@contextmanager
def serve_asgi(app: Any, send_buffer: int | None = None) -> Iterator[str]:
    """Run any ASGI app with uvicorn on a loopback port chosen now; yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            timeout_graceful_shutdown=2)
    srv = uvicorn.Server(config)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:  # accepted connections inherit it
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    listener.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: srv.started or not thread.is_alive(), "uvicorn starts")
        if not srv.started:
            raise RuntimeError("uvicorn did not start")
        port = srv.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)
        listener.close()


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll `predicate` until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)


def wait_drained(engine: AsyncEngine | AsyncLLM, timeout: float = 30.0) -> None:
    """Poll, between two engine steps, until the engine has no work left (every output, aborts
    included, delivered) and EngineCore.assert_drained holds; fail with the last complaint after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            engine.call_utility("check_drained")
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.01)


class _Gate:
    """Resumes the paused engine once `set()` (idempotent)."""

    def __init__(self, engine: AsyncEngine | AsyncLLM) -> None:
        self.engine = engine
        self.opened = False

    def set(self) -> None:
        if not self.opened:
            self.opened = True
            self.engine.call_utility("resume")


@contextmanager
def engine_paused(engine: AsyncEngine | AsyncLLM) -> Iterator[_Gate]:
    """Hold the engine before its next step until the returned gate is set (or the block
    exits): requests are admitted and queued, but none progresses or finishes."""
    gate = _Gate(engine)
    engine.call_utility("pause")
    try:
        yield gate
    finally:
        gate.set()
