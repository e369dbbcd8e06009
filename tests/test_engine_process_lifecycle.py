"""The engine-core process's life: a start-up error reaches the front end with the core's message,
shutdown leaves no process behind, a core whose front end was killed exits by itself, and a core
whose loop raised names the exception to its front end."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from photon import SamplingParams
from photon.engine.async_engine import EngineUnavailableError
from photon.engine.async_llm import AsyncLLM
from photon.engine.core_client import CoreClient, CoreGoneError, CoreStartError
from photon.engine.core_proc import FAULT_STEP_ENV, client_addresses
from photon.engine.engine_core import EngineCore
from photon.engine.messages import Abort
from photon.engine_args import EngineArgs
from photon.server.app import build_app
from photon.server.openai_serving import ServerConfig
from tests.server_util import TINY_ARGS, serve_app

EXIT_WAIT_S = 30.0  # bound on waiting for a process to go
START_WAIT_S = 120.0  # bound on a front end's start (model build in the core included)


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z", "X")  # a zombie runs nothing: only its exit status is left


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc: each process's parent id)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _wait_gone(pids: list[int]) -> list[int]:
    """Poll (bounded) until every pid is gone; those still alive at the bound."""
    deadline = time.monotonic() + EXIT_WAIT_S
    while time.monotonic() < deadline:
        alive = [p for p in pids if not _gone(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


def test_start_error_carries_the_cores_message() -> None:
    """A KV cache too small for max_model_len: AsyncLLM raises what EngineCore raises in
    process, type name and message, and no core process is left."""
    config = EngineArgs(**{**TINY_ARGS, "num_gpu_blocks_override": 2}).create_config()
    with pytest.raises(Exception) as in_process:
        EngineCore(config)
    before = set(_descendants(os.getpid()))
    with pytest.raises(CoreStartError) as remote:
        AsyncLLM(config)
    assert str(remote.value) == f"{type(in_process.value).__name__}: {in_process.value}"
    assert "num_gpu_blocks_override" in str(remote.value)
    assert _wait_gone(sorted(set(_descendants(os.getpid())) - before)) == []


def test_closing_a_client_whose_core_is_gone_does_not_block(tmp_path: Path) -> None:
    """A core that exited after its start error but is not yet reaped looks alive and has no
    socket connected: the Shutdown courtesy must not block close() (a PUSH send without a peer
    waits forever), so a failed start raises instead of hanging."""
    client = CoreClient(client_addresses(str(tmp_path), 1)[0])
    client.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    closer = threading.Thread(target=client.close, kwargs={"timeout_s": 0.1}, daemon=True)
    closer.start()
    closer.join(30)
    finished = not closer.is_alive()
    if not finished:
        client.proc.kill()
    assert finished, "close() blocked sending Shutdown to a core with no connected socket"
    assert client.proc.returncode is not None  # terminated and reaped


def test_a_send_to_a_core_that_exited_raises_instead_of_blocking(tmp_path: Path) -> None:
    """No peer is connected and the core has exited: a request (and a utility call) must fail
    with the core's exit, not wait forever on the PUSH socket; an abort is dropped."""
    client = CoreClient(client_addresses(str(tmp_path), 1)[0])
    client.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    client.proc.wait(30)
    outcome: list[BaseException | None] = []

    def send() -> None:
        try:
            client.send(Abort(["x"]))
        except BaseException as e:  # noqa: BLE001 - the outcome is the assertion
            outcome.append(e)
        else:
            outcome.append(None)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(30)
    blocked = sender.is_alive()
    client.close(timeout_s=0.1)
    assert not blocked, "send() blocked on a core that exited"
    assert isinstance(outcome[0], CoreGoneError)


def test_shutdown_leaves_no_process() -> None:
    engine = AsyncLLM(EngineArgs(**TINY_ARGS).create_config())
    engine.start()
    core = engine.client.proc
    assert engine.client.ready.pid == core.pid
    tree = [core.pid, *_descendants(core.pid)]
    engine.shutdown()
    assert core.returncode == 0  # stopped cleanly
    assert not engine.healthy
    assert _wait_gone(tree) == []


_FRONT_END = textwrap.dedent("""
    import sys
    from photon.engine_args import EngineArgs
    from photon.engine.async_llm import AsyncLLM
    engine = AsyncLLM(EngineArgs(model="photon-tiny-random", max_model_len=256, max_num_seqs=4,
                                 seed=0).create_config())
    engine.start()
    print(engine.client.proc.pid, flush=True)
    sys.stdin.read()  # until the test kills this process
""")


def test_core_exits_when_its_front_end_is_killed() -> None:
    """The core notices its parent is gone (it polls while idle) and exits: no orphan engine."""
    front = subprocess.Popen([sys.executable, "-c", _FRONT_END], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    tree: list[int] = []
    try:
        ready, _, _ = select.select([front.stdout], [], [], START_WAIT_S)
        line = front.stdout.readline() if ready else ""
        assert line.strip().isdigit(), f"the front end printed {line!r}"
        tree = [int(line), *_descendants(int(line))]
        assert not _gone(tree[0])
        front.send_signal(signal.SIGKILL)
        front.wait(EXIT_WAIT_S)
        assert _wait_gone(tree) == []
    finally:
        _reap(front, tree)


def _reap(front: subprocess.Popen, tree: list[int]) -> None:
    """Whatever the test left running (only on failure): the front end, then the core's tree."""
    if front.poll() is None:
        front.kill()
        front.wait(EXIT_WAIT_S)
    for pid in tree:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    front.stdin.close()
    front.stdout.close()


FAULTY_STEP = "3"
FAULT_TEXT = "RuntimeError: fault injected at step 3"


async def _run_until_error(engine: AsyncLLM) -> tuple[int, BaseException | None]:
    """A long request: how many outputs it got before its stream raised, and what it raised."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    got = 0
    try:
        async for _ in engine.generate([5, 6, 7], params, "long"):
            got += 1
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return got, e
    return got, None


def test_a_failing_core_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """The core's step raises after start-up: the open request, and a later one, fail with
    EngineUnavailableError naming the exception's type and message; `dead` is set, and the core
    process is reaped on shutdown."""
    monkeypatch.setenv(FAULT_STEP_ENV, FAULTY_STEP)
    engine = AsyncLLM(EngineArgs(**TINY_ARGS).create_config())
    core = engine.client.proc
    try:
        engine.start()
        got, error = asyncio.run(asyncio.wait_for(_run_until_error(engine), START_WAIT_S))
        assert got < 200 and isinstance(error, EngineUnavailableError)
        assert str(error).startswith(f"the engine core failed: {FAULT_TEXT} ")
        assert engine.dead.wait(EXIT_WAIT_S) and not engine.healthy
        with pytest.raises(EngineUnavailableError, match=FAULT_TEXT):
            asyncio.run(_run_until_error_raising(engine))
    finally:
        engine.shutdown()
    assert core.returncode == 1
    assert _wait_gone([core.pid]) == []


async def _run_until_error_raising(engine: AsyncLLM) -> None:
    async for _ in engine.generate([5, 6], SamplingParams(max_tokens=2), "later"):
        pass


def test_a_failing_core_answers_503_with_its_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over HTTP: the request in flight when the core's step raises, and a later one, get 503
    with the exception's text in the error body; /health turns 503."""
    monkeypatch.setenv(FAULT_STEP_ENV, FAULTY_STEP)
    config = EngineArgs(**TINY_ARGS).create_config()
    engine = AsyncLLM(config)
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}
    try:
        app = build_app(engine, ServerConfig(served_model_name=config.model.served_model_name,
                                             max_model_len=config.model.max_model_len))
        with serve_app(app) as live:
            for _ in range(2):
                r = httpx.post(live.api_url + "/completions", json=body, timeout=60)
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "engine_dead"
                assert FAULT_TEXT in r.json()["error"]["message"]
            assert httpx.get(live.base_url + "/health", timeout=10).status_code == 503
    finally:
        engine.shutdown()
