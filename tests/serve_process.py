"""A real `photon serve` subprocess for tests: its port, its stderr, its descendants by PID."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from tests.server_util import api_server_count, wait_until

# uvicorn's line, or with several API servers the launcher's
_RUNNING = re.compile(r"(?:running on|API servers on) http://127\.0\.0\.1:(\d+)")


@dataclass(frozen=True)
class Pid:
    """A process by id and start time (a reused id is another process)."""

    pid: int
    start: str

    @staticmethod
    def of(pid: int) -> Pid | None:
        stat = _stat(pid)
        return None if stat is None else Pid(pid, stat[19])

    def alive(self) -> bool:
        """Running (a zombie has ended: only its exit status waits to be collected)."""
        stat = _stat(self.pid)
        return stat is not None and stat[19] == self.start and stat[0] != "Z"


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], children(pid)
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children(child)
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    port: int = 0
    stderr: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def descendants(self) -> list[Pid]:
        return [p for p in map(Pid.of, descendants(self.proc.pid)) if p is not None]

    def core_pid(self) -> int:
        """The engine-core process: the server's child running photon.engine.core_proc."""
        cores = [c for c in children(self.proc.pid) if "photon.engine.core_proc" in cmdline(c)]
        assert len(cores) == 1, cores
        return cores[0]

    def wait_exit(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        assert self.reader is not None
        self.reader.join(timeout)
        return code

    def stderr_text(self) -> str:
        return "".join(self.stderr)


def _read_stderr(server: ServeProcess, started: threading.Event) -> None:
    assert server.proc.stderr is not None
    for line in server.proc.stderr:
        server.stderr.append(line)
        found = _RUNNING.search(line)
        if found:
            server.port = int(found.group(1))
            started.set()
    started.set()  # it exited without starting


@contextmanager
def serve_process(*args: str, timeout: float = 300.0) -> Iterator[ServeProcess]:
    """`photon serve` on photon-tiny-random on a free loopback port (`--port 0`), with
    `--api-server-count` from PHOTON_TEST_API_SERVERS, yielded once it answers; on exit, it and
    every descendant are killed if still running, and it is reaped."""
    count = api_server_count()
    cmd = [sys.executable, "-m", "photon.cli", "serve", "--model", "photon-tiny-random",
           "--port", "0", "--seed", "0",
           "--api-server-count", str(count), *args]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    server = ServeProcess(proc)
    started = threading.Event()
    server.reader = threading.Thread(target=_read_stderr, args=(server, started), daemon=True)
    server.reader.start()
    family: list[Pid] = []
    try:
        assert started.wait(timeout), "photon serve did not start"
        assert server.port, f"photon serve exited: {server.stderr_text()}"
        wait_until(lambda: _healthy(server), "photon serve answers", timeout)
        family = server.descendants()
        yield server
    finally:
        for p in family:
            if p.alive():
                os.kill(p.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        server.reader.join(30)
        assert proc.stderr is not None
        proc.stderr.close()


def _healthy(server: ServeProcess) -> bool:
    assert server.proc.poll() is None, f"photon serve exited: {server.stderr_text()}"
    try:
        return httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_all_gone(pids: list[Pid], timeout: float = 30.0) -> None:
    wait_until(lambda: not any(p.alive() for p in pids),
               f"every process ends ({[p.pid for p in pids if p.alive()]} still run)", timeout)
