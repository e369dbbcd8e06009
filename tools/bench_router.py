"""KV-aware routing benchmark: N `photon serve` replicas behind `photon router`, one run of the
multi-turn chat workload (`photon bench serve --dataset-name multiturn`) per routing policy,
and the reference: one replica with N times the KV blocks, which holds every cache.

Usage (CPU, three photon-tiny replicas, a few minutes):
    python tools/bench_router.py --replicas 3 --model photon-tiny --device cpu \\
        --num-conversations 24 --num-turns 4 --system-prompt-len 512 --num-groups 6 \\
        --turn-len 64 --output-len 16 --output-dir bench_router_out
GPU: --model-shape qwen3-0.6b (random weights of that shape) or --model DIR, --devices 0 1 puts
replica i on CUDA device devices[i % len].

Every replica publishes KV events (--kv-events-config binding tcp://*:P, replay tcp://*:P+1,
ports chosen at run time on loopback). Between policies the replicas' prefix caches are emptied
with POST /reset_prefix_cache once each replica is idle (retried while it answers 409, for at
most --reset-timeout seconds); --restart-between restarts the replicas instead (as does a server
without the endpoint). Each policy gets a router of its own, so its prefix index starts empty
(a new router replays the events the replicas still buffer, AllBlocksCleared included). Writes
OUTPUT_DIR/POLICY.json (the bench's summary) for each policy and `reference`, and
OUTPUT_DIR/table.md; prints the table. Every process it starts is stopped and reaped on exit,
on an error and on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

POLICIES = ("round_robin", "least_load", "prefix_aware")
START_TIMEOUT_S = 600.0
RESET_TIMEOUT_S = 120.0
POLL_S = 0.5
PHOTON = [sys.executable, "-m", "photon.cli"]


def free_port(pair: bool = False) -> int:
    """A loopback port free just now (`pair`: and the next one too, for the replay socket)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not pair:
            return port
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


def stop(procs: Sequence[Proc]) -> None:
    """SIGTERM every process, then SIGKILL those still up after 20 s; all reaped."""
    for p in procs:
        if p.popen.poll() is None:
            p.popen.terminate()
    deadline = time.monotonic() + 20.0
    for p in procs:
        try:
            p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()


@contextmanager
def started(name: str, cmd: list[str], logdir: Path, env: dict[str, str] | None = None
            ) -> Iterator[Proc]:
    log = logdir / f"{name}.log"
    with open(log, "w", encoding="utf-8") as out:
        popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, env=env)
    proc = Proc(name, popen, log)
    try:
        yield proc
    finally:
        stop([proc])


def wait_healthy(procs: Sequence[tuple[Proc, str]]) -> None:
    """Until every (process, URL) answers GET /health with 200; an exit is an error."""
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = list(procs)
    while pending:
        proc, url = pending[0]
        if proc.popen.poll() is not None:
            tail = proc.log.read_text(encoding="utf-8", errors="replace")[-2000:]
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} not healthy after {START_TIMEOUT_S:.0f} s")
        time.sleep(0.5)


@dataclass(frozen=True)
class Replica:
    url: str
    events: str  # where a subscriber connects


def serve_cmd(ns: argparse.Namespace, model: str, port: int, events_port: int,
              num_blocks: int | None) -> list[str]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{events_port}",
              "replay_endpoint": f"tcp://*:{events_port + 1}", "topic": "kv-events"}
    cmd = [*PHOTON, "serve", "--model", model, "--port", str(port),
           "--block-size", str(ns.block_size), "--device", ns.device,
           "--kv-events-config", json.dumps(events), "--log-level", "warning"]
    if num_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(num_blocks)]
    return cmd + list(ns.serve_arg or [])


@contextmanager
def replicas(ns: argparse.Namespace, model: str, count: int, num_blocks: int | None,
             logdir: Path, tag: str) -> Iterator[list[Replica]]:
    """`count` photon serve processes, healthy; stopped and reaped on exit."""
    with ExitStack() as stack:
        out, procs = [], []
        for i in range(count):
            port, events = free_port(), free_port(pair=True)
            env = dict(os.environ)
            if ns.devices:
                env["CUDA_VISIBLE_DEVICES"] = str(ns.devices[i % len(ns.devices)])
            proc = stack.enter_context(started(f"{tag}-replica{i}", serve_cmd(
                ns, model, port, events, num_blocks), logdir, env))
            url = f"http://127.0.0.1:{port}"
            procs.append((proc, url))
            out.append(Replica(url, f"tcp://127.0.0.1:{events}"))
        wait_healthy(procs)
        yield out


def busy(url: str) -> float:
    """The requests running or waiting on the server at `url` (its /metrics gauges; 0 when it
    has none)."""
    from photon.router.health import parse_load

    resp = httpx.get(url + "/metrics", timeout=30.0)
    load = parse_load(resp.text) if resp.status_code == 200 else None
    return 0.0 if load is None else load.running + load.waiting


def reset_cache(url: str, timeout_s: float = RESET_TIMEOUT_S, poll_s: float = POLL_S) -> bool:
    """Empty the prefix cache of the server at `url`: POST /reset_prefix_cache once it is idle,
    again while it answers 409 (requests still hold KV blocks), for at most `timeout_s`.
    False when the server has no such endpoint; RuntimeError when it stays busy or fails."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = None
        if busy(url) == 0:
            status = httpx.post(url + "/reset_prefix_cache", timeout=30.0).status_code
            if status == 200:
                return True
            if status in (404, 405):
                return False
            if status != 409:
                raise RuntimeError(f"POST {url}/reset_prefix_cache answered {status}")
        if time.monotonic() > deadline:
            why = "answered 409" if status == 409 else "still has requests"
            raise RuntimeError(f"{url} {why} after {timeout_s:.0f} s: its prefix cache could "
                               f"not be reset (--reset-timeout, or --restart-between)")
        time.sleep(poll_s)


def reset_caches(reps: Sequence[Replica], timeout_s: float = RESET_TIMEOUT_S) -> bool:
    """Every replica's prefix cache emptied; False when a replica lacks POST
    /reset_prefix_cache (then restart them)."""
    return all(reset_cache(r.url, timeout_s) for r in reps)


@contextmanager
def router(ns: argparse.Namespace, reps: Sequence[Replica], policy: str, logdir: Path
           ) -> Iterator[str]:
    port = free_port()
    cmd = [*PHOTON, "router", "--policy", policy, "--port", str(port),
           "--block-size", str(ns.block_size), "--log-level", "warning",
           "--backends", *[r.url for r in reps], "--kv-events", *[r.events for r in reps]]
    with started(f"router-{policy}", cmd, logdir) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy([(proc, url)])
        yield url


def bench(ns: argparse.Namespace, base_url: str, metrics_urls: Sequence[str], label: str,
          tokenizer: str, out: Path) -> dict:
    """One multiturn run; its summary (also written to out/LABEL.json)."""
    path = out / f"{label}.json"
    cmd = [*PHOTON, "bench", "serve", "--base-url", base_url, "--endpoint", ns.endpoint,
           "--dataset-name", "multiturn", "--tokenizer", tokenizer, "--label", label,
           "--num-conversations", str(ns.num_conversations), "--num-turns", str(ns.num_turns),
           "--system-prompt-len", str(ns.system_prompt_len), "--num-groups", str(ns.num_groups),
           "--turn-len", str(ns.turn_len), "--output-len", str(ns.output_len),
           "--seed", str(ns.seed), "--metrics-urls", *metrics_urls, "--output-json", str(path)]
    if ns.max_concurrency:
        cmd += ["--max-concurrency", str(ns.max_concurrency)]
    print(f"[bench_router] {label}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text(encoding="utf-8"))


def _f(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def table(rows: Sequence[tuple[str, dict]]) -> str:
    lines = ["| policy | prefix hit rate | prefill tokens | TTFT p50 (ms) | TTFT p99 (ms) | "
             "TPOT p50 (ms) | output tok/s | failed |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in rows:
        lines.append(f"| {name} | {_f(s['prefix_hit_rate'], '.3f')} | {s['prefill_tokens']} | "
                     f"{_f(s['median_ttft_ms'], '.0f')} | {_f(s['p99_ttft_ms'], '.0f')} | "
                     f"{_f(s['median_tpot_ms'], '.1f')} | {_f(s['output_throughput'], '.1f')} "
                     f"| {s['failed']} |")
    return "\n".join(lines)


def run_policies(ns: argparse.Namespace, model: str, tokenizer: str, out: Path,
                 logdir: Path) -> list[tuple[str, dict]]:
    """Every policy against the same replicas (their caches reset between runs, or the
    replicas restarted), each behind a router of its own."""
    rows: list[tuple[str, dict]] = []
    with ExitStack() as fleet:
        reps = fleet.enter_context(replicas(ns, model, ns.replicas, ns.num_blocks, logdir,
                                            "fleet"))
        for i, policy in enumerate(ns.policies):
            if i and (ns.restart_between or not reset_caches(reps, ns.reset_timeout)):
                if not ns.restart_between:
                    print("[bench_router] no POST /reset_prefix_cache: restarting the replicas",
                          file=sys.stderr, flush=True)
                fleet.close()
                reps = fleet.enter_context(replicas(ns, model, ns.replicas, ns.num_blocks,
                                                    logdir, f"fleet{i}"))
            with router(ns, reps, policy, logdir) as url:
                rows.append((policy, bench(ns, url, [r.url for r in reps], policy, tokenizer,
                                           out)))
    return rows


def run_reference(ns: argparse.Namespace, model: str, tokenizer: str, out: Path,
                  logdir: Path) -> tuple[str, dict]:
    blocks = ns.num_blocks * ns.replicas if ns.num_blocks else None
    with replicas(ns, model, 1, blocks, logdir, "reference") as (rep,):
        return (f"one replica, {ns.replicas}x KV blocks" if blocks else "one replica",
                bench(ns, rep.url, [rep.url], "reference", tokenizer, out))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--model", default="photon-tiny")
    p.add_argument("--model-shape", default=None,
                   help="A built-in shape with random weights (overrides --model).")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--devices", nargs="+", default=None, help="CUDA devices, one per replica.")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per replica (default: the server's own sizing).")
    p.add_argument("--serve-arg", action="append", default=None,
                   help="One more `photon serve` argument (repeat it).")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--restart-between", action="store_true",
                   help="Restart the replicas between policies (default: POST "
                        "/reset_prefix_cache on each, once idle).")
    p.add_argument("--reset-timeout", type=float, default=RESET_TIMEOUT_S, metavar="S",
                   help="Seconds to wait for a replica to go idle and accept the reset.")
    p.add_argument("--endpoint", default="/v1/chat/completions")
    p.add_argument("--num-conversations", type=int, default=64)
    p.add_argument("--num-turns", type=int, default=6)
    p.add_argument("--system-prompt-len", type=int, default=2048)
    p.add_argument("--num-groups", type=int, default=16)
    p.add_argument("--turn-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench_router_out")
    ns = p.parse_args(argv)
    if ns.replicas < 1:
        p.error(f"--replicas must be at least 1, got {ns.replicas}")
    if not ns.reset_timeout > 0:
        p.error(f"--reset-timeout must be > 0 seconds, got {ns.reset_timeout}")
    return ns


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the context managers: every process is stopped


def main(argv: Sequence[str] | None = None) -> int:
    from photon.bench.shapes import materialize_shape
    from photon.model.tiny import resolve_model_path

    ns = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    out = Path(ns.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        model = materialize_shape(ns.model_shape, tmp) if ns.model_shape \
            else resolve_model_path(ns.model)
        logdir = out / "logs"
        logdir.mkdir(exist_ok=True)
        rows = run_policies(ns, model, model, out, logdir)
        if not ns.no_reference:
            rows.append(run_reference(ns, model, model, out, logdir))
    text = table(rows)
    (out / "table.md").write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
