"""The test servers with several API server processes: what `photon serve --api-server-count N`
runs (one engine core, N `photon.server.api_server` processes on one inherited listening socket,
Prometheus metrics shared through files), started by the test process, which also attaches a
front end of its own to the core (no HTTP): `LiveServer.engine`, for the tests' utility calls
(pause, resume, drain checks), its tokenizer and its health."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from photon.config import EngineConfig
from photon.engine.async_llm import AsyncLLM
from photon.engine.core_client import CoreClient, start_core
from photon.engine.core_proc import client_addresses
from photon.server.admission import Admission
from photon.server.api_server import ApiServerSpec
from photon.server.multi import (
    listening_socket,
    shared_server_config,
    start_api_server,
    stop_all,
)
from photon.server.openai_serving import ServerConfig
from tests.server_util import LiveServer, wait_until

START_WAIT_S = 300.0  # every process imports torch and builds its part


@contextmanager
def multi_live_server(config: EngineConfig, server: ServerConfig, count: int,
                      send_buffer: int | None = None) -> Iterator[LiveServer]:
    """`count` API server processes on a loopback port, one engine core; every process is
    stopped and reaped on exit."""
    directory = tempfile.mkdtemp(prefix="photon-test-serve-")
    metrics = os.path.join(directory, "metrics")
    os.mkdir(metrics)
    sock = listening_socket("127.0.0.1", 0)
    if send_buffer is not None:  # accepted connections inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    server = shared_server_config(server, directory)
    clients = client_addresses(directory, count + 1)  # the last: the test's own front end
    procs: dict[str, subprocess.Popen] = {}
    control: AsyncLLM | None = None
    try:
        procs["engine core"] = core = start_core(config, clients)
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics}
        for i in range(count):
            spec = ApiServerSpec(config, server, clients[i], i, core.pid, sock.fileno(),
                                 "warning")
            procs[f"API server {i}"] = start_api_server(spec, env)
        control = AsyncLLM(config, client=CoreClient.attach(clients[count], count, core.pid))
        control.start()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        _wait_up(url, procs)
        admission = Admission(config.scheduler.max_num_seqs, server.max_queued_requests,
                              server.shared_admission)
        yield LiveServer(None, url, control, admission)
    finally:
        sock.close()
        servers = {k: v for k, v in procs.items() if k != "engine core"}
        stop_all(servers)
        if control is not None:
            control.shutdown()
        stop_all(procs)
        shutil.rmtree(directory, ignore_errors=True)


def _wait_up(url: str, procs: dict[str, subprocess.Popen]) -> None:
    """Until every API server answers (each takes connections once its app is up)."""
    def up() -> bool:
        dead = [name for name, p in procs.items() if p.poll() is not None]
        assert not dead, f"{dead} exited while starting"
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, "the API servers are up", START_WAIT_S)
