"""`photon serve --api-server-count 2`: two API server processes on one port feed one engine core.
Requests on both give the in-process engine's greedy tokens, /metrics counts every server's
requests, and SIGTERM stops every process cleanly; a dead core stops the server with a non-zero
exit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from photon import LLM, SamplingParams
from tests.server_util import wait_until

ARGS = ["--max-model-len", "256", "--max-num-seqs", "16", "--seed", "0"]
PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(12)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        children.setdefault(pp, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture()
def server() -> Iterator[tuple[subprocess.Popen, str]]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "photon.cli", "serve", "photon-tiny-random",
                             "--api-server-count", "2", "--port", str(port), "--log-level", "warning", *ARGS],
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(url) or proc.poll() is not None, "the server is up", 120)
        assert proc.poll() is None, proc.stderr.read()
        yield proc, url
    finally:
        for pid in _descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _complete(url: str, prompt: list[int]) -> str:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_two_api_servers_serve_one_engine_and_sigterm_stops_them(
        server: tuple[subprocess.Popen, str]) -> None:
    """Two API servers serve one engine; then SIGTERM stops every process cleanly."""
    proc, url = server
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: _complete(url, p), PROMPTS))
    llm = LLM("photon-tiny-random", max_model_len=256, max_num_seqs=16, seed=0)
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)
    assert got == [o.outputs[0].text for o in expected]
    # every server's requests are counted, whichever server answers the scrape
    wait_until(lambda: _metric(url, "photon:generation_tokens_total") == 8 * len(PROMPTS),
          "the metrics count every token")
    assert _metric(url, "photon:request_success_total") == len(PROMPTS)
    stream = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4,
                                                       "stream": True}, timeout=60)
    events = [line for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    json.loads(events[0][6:])
    _sigterm_stops_every_process(proc)


def _sigterm_stops_every_process(proc: subprocess.Popen) -> None:
    children = _descendants(proc.pid)
    assert len(children) >= 3  # the core (and its grammar worker) and two API servers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert "Traceback" not in proc.stderr.read()
    wait_until(lambda: not any(_alive(p) for p in children), "every child exits", 30)


def test_a_dead_core_stops_the_server_with_an_error(server: tuple[subprocess.Popen, str]
                                                    ) -> None:
    proc, url = server
    core = [p for p in _descendants(proc.pid) if b"core_proc" in _cmdline(p)]
    assert len(core) == 1
    os.kill(core[0], signal.SIGKILL)
    assert proc.wait(60) == 1
    assert "photon serve: exiting: the engine core process was killed by SIGKILL" in \
        proc.stderr.read()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    from photon.engine.core_client import pid_alive

    return pid_alive(pid)
