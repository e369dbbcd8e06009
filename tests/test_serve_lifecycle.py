"""`photon serve` as a process: the engine core dying under a stream, and SIGTERM / Ctrl-C under
load. Each test runs a real server subprocess and checks its exit status, its stderr and that
every process it started has ended (by PID)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Callable

import httpx
import pytest

from photon.engine.async_llm import exit_cause
from tests.serve_process import ServeProcess, cmdline, serve_process, wait_all_gone
from tests.server_util import api_server_count

LONG = {"prompt": "once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
ARGS = ("--max-model-len", "1024")


def _stream(server: ServeProcess, events: list[str], first: threading.Event) -> None:
    """One long streaming completion: its `data:` payloads go to `events`; `first` is set once
    the first has come (or the stream failed)."""
    try:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=LONG,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    except httpx.HTTPError as e:
        events.append(f"client error: {e}")
    finally:
        first.set()


def _errors(events: list[str]) -> list[dict]:
    return [json.loads(e)["error"] for e in events if e.startswith("{") and '"error"' in e]


def _family_names(server: ServeProcess) -> list[str]:
    return [cmdline(p.pid) for p in server.descendants()]


def test_core_killed_mid_stream() -> None:
    """SIGKILL to the engine core: the open stream ends with an error event naming the cause,
    then [DONE]; health checks and new requests answered meanwhile are 503; the server exits
    with 1 and one line naming the cause (no traceback); no process it started survives."""
    with serve_process(*ARGS) as server:
        names = _family_names(server)
        assert any("photon.structured.worker" in n for n in names), names
        family = server.descendants()
        events: list[str] = []
        first = threading.Event()
        reader = threading.Thread(target=_stream, args=(server, events, first))
        reader.start()
        assert first.wait(120) and not events[0].startswith("client error"), events
        os.kill(server.core_pid(), signal.SIGKILL)
        reader.join(60)
        assert not reader.is_alive()
        assert events[-1] == "[DONE]", events[-3:]
        (error,) = _errors(events)
        # An API server of several cannot see the exit status of the core (not its child);
        # the launcher names it on stderr.
        words = "killed by SIGKILL" if api_server_count() == 1 else "core process exited"
        assert error["code"] == "engine_dead" and words in error["message"], error
        assert not any('"finish_reason":"length"' in e for e in events)
        _check_refused(server)
        assert server.wait_exit(30) == 1
        stderr = server.stderr_text()
        assert "Traceback" not in stderr, stderr
        assert "photon serve: exiting: the engine core process was killed by SIGKILL" in stderr
        wait_all_gone(family)


def _check_refused(server: ServeProcess) -> None:
    """While the server is still up (it may already have closed its port), /health is 503
    and a new request is refused with 503 engine_dead."""
    try:
        health = httpx.get(server.base_url + "/health", timeout=10)
        new = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    except httpx.TransportError:
        return  # already gone
    assert health.status_code == 503
    assert new.status_code == 503 and new.json()["error"]["code"] == "engine_dead"


@pytest.mark.parametrize("code, words", [
    (-signal.SIGKILL, "killed by SIGKILL"), (-signal.SIGSEGV, "killed by SIGSEGV"),
    (-200, "killed by signal 200"), (1, "exit code 1;")])
def test_exit_cause_names_the_signal_or_status(code: int, words: str) -> None:
    assert words in exit_cause(code)


def _sigterm(server: ServeProcess) -> None:
    server.proc.send_signal(signal.SIGTERM)


def _ctrl_c(server: ServeProcess) -> None:
    """What a terminal's Ctrl-C does: SIGINT to the foreground process group."""
    os.killpg(server.proc.pid, signal.SIGINT)


@pytest.mark.parametrize("stop", [_sigterm, _ctrl_c], ids=["sigterm", "ctrl-c"])
def test_shutdown_under_load(stop: Callable[[ServeProcess], None]) -> None:
    """Stopped with three streams in flight: each ends with an error event saying the server is
    shutting down, then [DONE]; exit status 0 with no traceback on stderr; the engine core and
    grammar worker are gone; the port can be bound again."""
    with serve_process(*ARGS) as server:
        family = server.descendants()
        assert len(family) >= 2, _family_names(server)  # the core and its grammar worker
        streams = [([], threading.Event()) for _ in range(3)]
        threads = [threading.Thread(target=_stream, args=(server, *s)) for s in streams]
        for t in threads:
            t.start()
        for events, first in streams:
            assert first.wait(120) and not events[0].startswith("client error"), events
        stop(server)
        assert server.wait_exit(60) == 0
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        stderr = server.stderr_text()
        assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
        for events, _ in streams:
            assert events[-1] == "[DONE]", events[-3:]
            assert [e["message"] for e in _errors(events)] == ["the server is shutting down"]
        wait_all_gone(family)
        with socket.socket() as sock:  # as a new server would bind it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", server.port))
            sock.listen()
