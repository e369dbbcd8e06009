"""tools/bench_router.py, without starting servers: the replicas' command lines (KV events bound
on a wildcard host, the replay socket at port + 1), the table, process reaping, the prefix
cache reset between policies (against a fake server) and when replicas are restarted instead."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from tests.server_util import serve_asgi

pytestmark = pytest.mark.timeout(120)

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_router.py"


@functools.cache
def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_router", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_router"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_replica_command_binds_events_and_replay() -> None:
    tool = _tool()
    ns = tool.parse_args(["--num-blocks", "64", "--serve-arg=--max-num-seqs=8"])
    cmd = tool.serve_cmd(ns, "MODEL", 9000, 9100, 64)
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    # A wildcard host binds (a named one would connect to a subscriber).
    assert events["endpoint"] == "tcp://*:9100" and events["replay_endpoint"] == "tcp://*:9101"
    assert cmd[cmd.index("--num-gpu-blocks-override") + 1] == "64"
    assert cmd[cmd.index("--port") + 1] == "9000" and cmd[-1] == "--max-num-seqs=8"
    port = tool.free_port(pair=True)
    assert 0 < port < 65535


def test_table_has_a_row_per_run() -> None:
    tool = _tool()
    summary = {"prefix_hit_rate": 0.5, "prefill_tokens": 10, "median_ttft_ms": 12.3,
               "p99_ttft_ms": 40.0, "median_tpot_ms": 2.0, "output_throughput": 100.0,
               "failed": 0}
    text = tool.table([("round_robin", summary), ("reference", {**summary,
                                                                "prefix_hit_rate": None})])
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[2] == "| round_robin | 0.500 | 10 | 12 | 40 | 2.0 | 100.0 | 0 |"
    assert lines[3].startswith("| reference | n/a |")


def test_started_processes_are_reaped_on_an_error(tmp_path: Path) -> None:
    tool = _tool()
    with pytest.raises(RuntimeError, match="boom"):
        with tool.started("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"],
                          tmp_path) as proc:
            raise RuntimeError("boom")
    assert proc.popen.returncode is not None  # stopped and waited for


def test_wait_healthy_reports_a_process_that_exited(tmp_path: Path) -> None:
    tool = _tool()
    with tool.started("crasher", [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"],
                      tmp_path) as proc:
        with pytest.raises(RuntimeError, match="crasher exited with 3:\nbad flag"):
            tool.wait_healthy([(proc, "http://127.0.0.1:1")])


@dataclass
class FakeServer:
    """/metrics with a running gauge that falls by one a scrape; /reset_prefix_cache answering
    `answers` in turn (then the last one)."""
    running: int
    answers: list[int]
    resets: int = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            running, self.running = self.running, max(0, self.running - 1)
            return PlainTextResponse(f"photon:num_requests_running {running}\n"
                                     f"photon:num_requests_waiting 0\n")

        @app.post("/reset_prefix_cache")
        async def reset() -> Response:
            status = self.answers[min(self.resets, len(self.answers) - 1)]
            self.resets += 1
            return Response(status_code=status)

        return app


def test_reset_waits_for_idle_and_retries_409() -> None:
    tool = _tool()
    fake = FakeServer(running=2, answers=[409, 200])
    with serve_asgi(fake.app()) as url:
        assert tool.reset_cache(url, timeout_s=30, poll_s=0.01)
        assert (fake.running, fake.resets) == (0, 2)  # reset only once idle; 409 retried
        busy = FakeServer(running=0, answers=[409])
        with serve_asgi(busy.app()) as busy_url:
            with pytest.raises(RuntimeError, match="answered 409 after 0 s: its prefix cache"):
                tool.reset_cache(busy_url, timeout_s=0.05, poll_s=0.01)
        missing = FakeServer(running=0, answers=[404])
        with serve_asgi(missing.app()) as missing_url:
            assert not tool.reset_cache(missing_url, timeout_s=30, poll_s=0.01)


@pytest.mark.parametrize("argv, reset, starts", [
    ([], True, ["fleet"]),  # reset between policies: one fleet
    (["--restart-between"], True, ["fleet", "fleet1", "fleet2"]),
    ([], False, ["fleet", "fleet1", "fleet2"]),  # no reset endpoint: restarted
])
def test_policies_share_the_replicas_unless_restarted(
        argv: list[str], reset: bool, starts: list[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tool = _tool()
    started: list[str] = []
    routers: list[str] = []

    @contextmanager
    def replicas(*args: object) -> Iterator[list[object]]:
        started.append(str(args[-1]))
        yield [tool.Replica("http://r:1", "tcp://r:2")]

    @contextmanager
    def router(ns: object, reps: object, policy: str, logdir: object) -> Iterator[str]:
        routers.append(policy)
        yield "http://router"

    monkeypatch.setattr(tool, "replicas", replicas)
    monkeypatch.setattr(tool, "router", router)
    monkeypatch.setattr(tool, "reset_caches", lambda reps, timeout_s: reset)
    monkeypatch.setattr(tool, "bench", lambda ns, url, m, label, tok, out: {"label": label})
    rows = tool.run_policies(tool.parse_args(argv), "M", "M", tmp_path, tmp_path)
    assert started == starts and routers == list(tool.POLICIES)  # a router per policy
    assert [r[0] for r in rows] == list(tool.POLICIES)
