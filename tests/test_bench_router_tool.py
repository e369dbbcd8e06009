"""tools/bench_router.py, without starting servers: the replicas' command lines (KV events bound
on a wildcard host, the replay socket at port + 1), the table, and process reaping."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

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
