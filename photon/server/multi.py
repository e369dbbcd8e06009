"""`photon serve --api-server-count N`: one engine-core process, N API server processes on one
port (as vLLM's option of the same name).

The launcher binds the listening socket, starts the core with the addresses of N front ends, then
N API servers (photon.server.api_server) that inherit the socket (the kernel spreads connections
over them) and attach to the core. Prometheus metrics are shared through files
(PROMETHEUS_MULTIPROC_DIR): any server's /metrics shows every server's request counts and
latencies, and the engine's own gauges once. The launcher supervises: if any of its processes
exits, it stops the others and exits non-zero, naming the one that died; SIGTERM or Ctrl-C stops
the API servers (graceful), then the core, and exits 0.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

from photon.config import EngineConfig
from photon.engine.async_llm import exit_cause
from photon.engine.core_client import start_core
from photon.engine.core_proc import client_addresses
from photon.server.admission import SharedCount
from photon.server.api_server import ApiServerSpec
from photon.server.openai_serving import ServerConfig

_POLL_S = 0.2
_SELF_EXIT_S = 15.0  # how long API servers get to exit by themselves once the core has died


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def shared_server_config(server: ServerConfig, directory: str) -> ServerConfig:
    """`server` for every API server of one deployment: one admission count in `directory`."""
    path = os.path.join(directory, "admission")
    SharedCount.create(path)
    return replace(server, shared_admission=path)


def serve_many(config: EngineConfig, server: ServerConfig, host: str, port: int, count: int,
               log_level: str) -> int:
    directory = tempfile.mkdtemp(prefix="photon-serve-")
    metrics_dir = os.path.join(directory, "metrics")
    os.mkdir(metrics_dir)
    stop = {"signal": False}

    def on_signal(signum: int, frame: Any) -> None:
        stop["signal"] = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    sock = listening_socket(host, port)
    clients = client_addresses(directory, count)
    server = shared_server_config(server, directory)
    procs: dict[str, subprocess.Popen] = {}
    died: tuple[str, int] | None = None
    try:
        procs["engine core"] = start_core(config, clients)
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        for i, addresses in enumerate(clients):
            spec = ApiServerSpec(config, server, addresses, i, procs["engine core"].pid,
                                 sock.fileno(), log_level)
            procs[f"API server {i}"] = start_api_server(spec, env)
        host_port = sock.getsockname()[:2]
        print(f"photon serve: {count} API servers on http://{host_port[0]}:{host_port[1]}",
              file=sys.stderr, flush=True)
        died = _supervise(procs, stop)
    finally:
        sock.close()
        # A dead core: the API servers end their streams with its cause and exit by themselves
        # (a SIGTERM now would end them with "shutting down" instead).
        stop_all(procs, _SELF_EXIT_S if died is not None and died[0] == "engine core" else 0)
        for s, handler in old.items():
            signal.signal(s, handler)
        shutil.rmtree(directory, ignore_errors=True)
    if died is None:
        return 0
    name, code = died
    cause = exit_cause(code) if name == "engine core" else f"the {name} exited (exit code {code})"
    print(f"photon serve: exiting: {cause}", file=sys.stderr)
    return 1


def start_api_server(spec: ApiServerSpec, env: dict[str, str]) -> subprocess.Popen:
    """One API server process (photon.server.api_server), which inherits `spec.fd`."""
    proc = subprocess.Popen([sys.executable, "-m", "photon.server.api_server"],
                            stdin=subprocess.PIPE, pass_fds=(spec.fd,), env=env)
    proc.stdin.write(pickle.dumps(spec))
    proc.stdin.close()
    return proc


def _supervise(procs: dict[str, subprocess.Popen], stop: dict[str, bool]
               ) -> tuple[str, int] | None:
    """Until a signal (None) or until one process exits ((its name, exit code))."""
    while not stop["signal"]:
        for name, proc in procs.items():
            code = proc.poll()
            if code is not None:
                return name, code
        time.sleep(_POLL_S)
    return None


def stop_all(procs: dict[str, subprocess.Popen], self_exit_s: float = 0) -> None:
    """API servers first (they finish their responses; given `self_exit_s` to exit before
    they are told to), then the core; then whatever is left is killed. Every process is
    reaped."""
    core = procs.get("engine core")
    servers = [p for name, p in procs.items() if p is not core]
    deadline = time.monotonic() + self_exit_s
    while time.monotonic() < deadline and any(p.poll() is None for p in servers):
        time.sleep(_POLL_S)
    for group in (servers, [core] if core is not None else []):
        for proc in group:
            if proc.poll() is None:
                proc.terminate()
        for proc in group:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
