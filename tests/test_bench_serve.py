"""`photon bench serve`: metrics, goodput, arrivals (pure) and the CLI against a stub server (CPU)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import Request  # module level: the handlers' annotations are strings

from photon.bench.serve_client import chunk_text, parse_sse_line
from photon.bench.serve_metrics import (
    RequestRecord,
    aggregate,
    arrival_intervals,
    arrival_offsets,
    count_good,
    latency_stats,
    meets_slos,
    parse_goodput,
    peak_concurrency,
)
from photon.bench.serve_workload import length_bounds, load_dataset, random_requests
from photon.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# SLO bounds no request can miss / meet: a year, and a nanosecond (an HTTP round trip is longer).
NEVER_MS, INSTANT_MS = 365 * 24 * 3600 * 1000.0, 1e-6

# ---------------------------------------------------------------- stub OpenAI server


@dataclass
class StubState:
    ttft_delay: float = 0.01
    token_delay: float = 0.02
    fail_output_len: int | None = None  # 400 for requests with this max_tokens
    card: dict[str, Any] = field(default_factory=dict)  # extra fields of the /v1/models card
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)


def _chunk(text: str, chat: bool) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {"id": "x", "object": "chunk", "model": "stub-model", "choices": [choice]}


async def _stream(state: StubState, body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
    n = body["max_tokens"]
    if chat:  # a role-only chunk first, as OpenAI servers send; it carries no text
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
    await asyncio.sleep(state.ttft_delay)
    for i in range(n):
        if i:
            await asyncio.sleep(state.token_delay)
        yield f"data: {json.dumps(_chunk(f' t{i}', chat))}\n\n"
    prompt = body["messages"][0]["content"].split() if chat else body["prompt"]
    usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


def _make_app(state: StubState) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "stub-model", "object": "model", **state.card}]}

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        state.bodies.append(body)
        state.auth.append(request.headers.get("authorization"))
        if body["max_tokens"] == state.fail_output_len:
            return JSONResponse({"error": {"message": "stub says no"}}, status_code=400)
        return StreamingResponse(_stream(state, body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def stub_server() -> Iterator[tuple[str, StubState]]:
    import uvicorn

    state = StubState()
    config = uvicorn.Config(_make_app(state), host="127.0.0.1", port=0, log_level="warning",
                            lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "stub server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]  # port 0: the OS picked one
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture()
def stub(stub_server: tuple[str, StubState]) -> tuple[str, StubState]:
    url, state = stub_server
    state.ttft_delay, state.token_delay, state.fail_output_len = 0.01, 0.02, None
    state.bodies.clear()
    state.auth.clear()
    state.card.clear()
    return url, state


def _bench(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = main(["bench", "serve", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- against the stub


def test_streamed_metrics(stub: tuple[str, StubState], capsys: pytest.CaptureFixture[str]) -> None:
    url, state = stub
    s = _bench(capsys, "--base-url", url, "--num-prompts", "6", "--random-input-len", "8",
               "--random-output-len", "5", "--goodput", f"ttft:{NEVER_MS}", f"tpot:{NEVER_MS}",
               "--label", "stub")
    assert (s["completed"], s["failed"], s["model"], s["label"]) == (6, 0, "stub-model", "stub")
    assert (s["total_output_tokens"], s["total_input_tokens"]) == (30, 48)
    assert s["output_len_mismatches"] == 0 and s["errors"] == []
    assert 0 < s["median_ttft_ms"] <= s["median_e2el_ms"]
    assert s["mean_tpot_ms"] > 0 and s["median_itl_ms"] > 0
    assert s["p99_ttft_ms"] >= s["median_ttft_ms"] and s["p99_e2el_ms"] >= s["p90_e2el_ms"]
    assert s["good_requests"] == 6 and s["request_goodput"] == pytest.approx(s["request_throughput"])
    assert s["output_throughput"] == pytest.approx(30 / s["duration_s"])
    assert s["request_rate"] == "inf" and 1 <= s["peak_concurrency"] <= 6
    body = state.bodies[-1]  # the last of the warm-up + 6 timed requests
    assert len(state.bodies) == 7 and body["max_tokens"] == 5 and len(body["prompt"]) == 8
    assert body["ignore_eos"] and body["stream"] and body["stream_options"]["include_usage"]


def test_goodput_slo_excludes(stub: tuple[str, StubState],
                              capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = stub
    s = _bench(capsys, "--base-url", url, "--num-prompts", "3", "--random-output-len", "4",
               "--random-input-len", "4", "--goodput", f"e2el:{INSTANT_MS}",
               "--warmup-requests", "0")
    assert s["completed"] == 3 and s["good_requests"] == 0 and s["request_goodput"] == 0
    assert s["goodput_slos_ms"] == {"e2el": INSTANT_MS}


def test_warmup_requests_run_before_the_timed_ones(stub: tuple[str, StubState],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    url, state = stub
    s = _bench(capsys, "--base-url", url, "--num-prompts", "2", "--random-output-len", "3",
               "--random-input-len", "4", "--warmup-requests", "5")
    assert s["completed"] == 2 and len(state.bodies) == 7  # 5 warm-ups (one, then four at once)


def test_chat_endpoint_and_api_key(stub: tuple[str, StubState], capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    url, state = stub
    monkeypatch.setenv("PHOTON_API_KEY", "sekrit")
    s = _bench(capsys, "--base-url", url, "--endpoint", "/v1/chat/completions", "--model", "m",
               "--num-prompts", "4", "--random-input-len", "6", "--random-output-len", "3",
               "--max-concurrency", "2", "--request-rate", "100")
    assert (s["completed"], s["total_output_tokens"], s["total_input_tokens"]) == (4, 12, 24)
    assert s["max_concurrency"] == 2 and s["peak_concurrency"] <= 2
    assert s["median_ttft_ms"] > 0  # the role-only chunk did not count as the first token
    assert isinstance(state.bodies[-1]["messages"][0]["content"], str)
    assert state.auth[-1] == "Bearer sekrit" and state.bodies[-1]["model"] == "m"


def test_failures_are_counted(stub: tuple[str, StubState], capsys: pytest.CaptureFixture[str],
                              tmp_path: Path) -> None:
    url, state = stub
    state.fail_output_len = 4
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": [1, 2, 3], "output_len": 3}, {"prompt": "hello there", "output_len": 4}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = _bench(capsys, "--base-url", url, "--dataset", str(data), "--num-prompts", "4")
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (2, 2, 6)
    assert s["errors"][0]["count"] == 2 and "HTTP 400" in s["errors"][0]["error"]


def test_warmup_failure_aborts(stub: tuple[str, StubState],
                               capsys: pytest.CaptureFixture[str]) -> None:
    url, state = stub
    state.fail_output_len = 2
    code = main(["bench", "serve", "--base-url", url, "--num-prompts", "2",
                 "--random-output-len", "2", "--random-input-len", "2"])
    assert code == 1 and "warm-up request failed" in capsys.readouterr().err


def test_sweep_writes_json_and_png(stub: tuple[str, StubState], capsys: pytest.CaptureFixture[str],
                                   tmp_path: Path) -> None:
    url, state = stub
    state.token_delay = 0.005
    s = _bench(capsys, "--base-url", url, "--num-prompts", "4", "--random-input-len", "4",
               "--random-output-len", "3", "--sweep", "200", "inf", "--label", "pipelined",
               "--output-dir", str(tmp_path), "--warmup-requests", "0")
    assert s["benchmark"] == "serve_sweep" and s["label"] == "pipelined"
    assert [p["request_rate"] for p in s["points"]] == [200.0, "inf"]
    assert all(p["completed"] == 4 for p in s["points"])
    saved = json.loads((tmp_path / "pipelined.json").read_text())
    assert len(saved["points"]) == 2
    png = (tmp_path / "pipelined.png").read_bytes()
    assert png[:8] == PNG_SIGNATURE and len(png) > 1000


def test_unreachable_server_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]) == 1
    assert "is the server up?" in capsys.readouterr().err


def test_prompt_ids_sized_to_the_servers_vocabulary(stub: tuple[str, StubState],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    url, state = stub
    state.card.update(vocab_size=50, max_model_len=4096)
    s = _bench(capsys, "--base-url", url, "--num-prompts", "8", "--random-input-len", "64",
               "--random-output-len", "2", "--warmup-requests", "0")
    assert s["completed"] == 8 and s["random_vocab_size"] == 50
    ids = [t for body in state.bodies for t in body["prompt"]]
    assert len(ids) == 8 * 64 and max(ids) < 50 and len(set(ids)) > 25
    # --random-vocab-size still wins over the server's value.
    state.bodies.clear()
    s = _bench(capsys, "--base-url", url, "--num-prompts", "2", "--random-input-len", "64",
               "--random-output-len", "2", "--warmup-requests", "0", "--random-vocab-size", "7")
    assert s["random_vocab_size"] == 7
    assert max(t for body in state.bodies for t in body["prompt"]) < 7


def test_no_vocab_size_from_the_server_keeps_the_default(
        stub: tuple[str, StubState], capsys: pytest.CaptureFixture[str]) -> None:
    from photon.bench.serve import DEFAULT_VOCAB_SIZE

    url, _ = stub  # a card with only an id, as OpenAI's servers give
    s = _bench(capsys, "--base-url", url, "--num-prompts", "2", "--random-input-len", "4",
               "--random-output-len", "2", "--warmup-requests", "0")
    assert s["random_vocab_size"] == DEFAULT_VOCAB_SIZE == 10000


def test_requests_longer_than_the_servers_context_are_refused_up_front(
        stub: tuple[str, StubState], capsys: pytest.CaptureFixture[str]) -> None:
    url, state = stub
    state.card.update(max_model_len=256)
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "3"]) == 2
    err = capsys.readouterr().err
    assert ("3 of 3 requests do not fit the server's max_model_len of 256 tokens (the longest: "
            "1024 prompt + 128 output tokens); lower --random-input-len / --random-output-len"
            in err)
    assert state.bodies == []  # nothing was sent


def test_cost_per_million_output_tokens(stub: tuple[str, StubState],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = stub
    code = main(["bench", "serve", "--base-url", url, "--num-prompts", "3",
                 "--random-input-len", "4", "--random-output-len", "3", "--warmup-requests", "0",
                 "--gpu-cost-per-hour", "1.8", "--num-gpus", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    s = json.loads(out.strip().splitlines()[-1])
    assert (s["gpu_cost_per_hour"], s["num_gpus"]) == (1.8, 2)
    # 2 GPUs at $1.80 an hour = $0.001 a second: per million tokens, 1000 / (tokens per second).
    assert s["dollars_per_million_output_tokens"] == pytest.approx(1e3 / s["output_throughput"])
    cost = s["dollars_per_million_output_tokens"]
    assert f"{'Cost ($ per 1M output tokens)':<36}{cost:.2f}\n" in err  # the human table
    for bad, says in ((["--gpu-cost-per-hour", "-2"], "--gpu-cost-per-hour must be"),
                      (["--num-gpus", "0"], "--num-gpus must be at least 1, got 0")):
        assert main(["bench", "serve", "--base-url", url, *bad]) == 2
        assert says in capsys.readouterr().err


def test_against_a_live_photon_server(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's sweep against photon-tiny, with the client's defaults for the vocabulary."""
    import httpx

    from tests.server_util import live_server

    with live_server() as srv:
        card = httpx.get(srv.base_url + "/v1/models", timeout=30).json()["data"][0]
        assert (card["vocab_size"], card["max_model_len"]) == (1024, 256)
        s = _bench(capsys, "--base-url", srv.base_url, "--num-prompts", "4",
                   "--random-input-len", "24", "--random-output-len", "3",
                   "--sweep-concurrency", "1", "4")
    assert [p["max_concurrency"] for p in s["points"]] == [1, 4]
    for point in s["points"]:
        assert (point["completed"], point["failed"], point["errors"]) == (4, 0, [])
        assert point["random_vocab_size"] == 1024 and point["total_output_tokens"] == 12
        assert point["total_input_tokens"] == 4 * 24


@pytest.mark.parametrize(("module", "argv"), [
    ("aiohttp", ["--base-url", "http://127.0.0.1:9"]),
    ("matplotlib", ["--plot-from", "runs.json"]),
])
def test_missing_bench_extra_says_how_to_install(module: str, argv: list[str],
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    assert main(["bench", "serve", *argv]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("photon bench serve: error: ")
    assert line.endswith(f"needs {module}, which is not installed: "
                         "pip install 'photon-llm[bench]'")


# ---------------------------------------------------------------- plotting (no server)


def _point(label: str, rate: float, tput: float, tpot: float) -> dict[str, Any]:
    return {"benchmark": "serve", "label": label, "request_rate": rate, "sweep": "request_rate",
            "output_throughput": tput, "median_tpot_ms": tpot, "p99_ttft_ms": 10 * tpot}


def test_plot_from_merges_two_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"benchmark": "serve_sweep", "label": "pipelined",
                             "points": [_point("pipelined", r, 100 * r, 10 + r) for r in (1, 2)]}))
    b = tmp_path / "b.jsonl"  # JSON lines of single-run summaries
    b.write_text("\n".join(json.dumps(_point("blocking", r, 80 * r, 12 + r)) for r in (1, 2, 4)))
    out = tmp_path / "cmp.png"
    s = _bench(capsys, "--plot-from", str(a), str(b), "--plot-output", str(out))
    assert s["series"] == {"pipelined": 2, "blocking": 3}
    assert out.read_bytes()[:8] == PNG_SIGNATURE


# ---------------------------------------------------------------- pure functions


def _rec(ttft: float, latency: float, out: int, ok: bool = True, start: float = 0.0,
         itl: list[float] | None = None) -> RequestRecord:
    return RequestRecord(success=ok, output_len=out, prompt_tokens=10, output_tokens=out if ok else 0,
                         ttft=ttft, itl=itl or [], latency=latency, start=start,
                         error="" if ok else "boom")


def test_tpot_and_aggregate() -> None:
    records = [_rec(0.1, 1.1, 11, itl=[0.1] * 10), _rec(0.2, 0.2, 1),
               _rec(0.5, 2.5, 5, ok=False)]
    assert records[0].tpot() == pytest.approx(0.1) and records[1].tpot() == 0.0
    m = aggregate(records, duration=2.0)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (2, 1, 12)
    assert m["total_input_tokens"] == 20 and m["request_throughput"] == 1.0
    assert m["output_throughput"] == 6.0 and m["total_token_throughput"] == 16.0
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # one-token requests have no TPOT
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["median_itl_ms"] == pytest.approx(100)
    assert m["request_goodput"] is None and m["errors"] == [{"error": "boom", "count": 1}]


def test_latency_stats_percentiles() -> None:
    s = latency_stats("x", [float(v) for v in range(1, 101)])
    assert s["median_x_ms"] == pytest.approx(50.5) and s["mean_x_ms"] == pytest.approx(50.5)
    assert s["p99_x_ms"] == pytest.approx(99.01) and s["p90_x_ms"] == pytest.approx(90.1)
    assert latency_stats("x", [])["p99_x_ms"] is None


def test_goodput_needs_every_slo() -> None:
    slos = parse_goodput(["ttft:200", "tpot:50", "e2el:1000"])
    assert slos == {"ttft": 200.0, "tpot": 50.0, "e2el": 1000.0}
    good = _rec(0.1, 0.5, 11)                 # ttft 100, tpot 40, e2e 500
    slow_ttft = _rec(0.3, 0.7, 11)            # ttft 300
    slow_tpot = _rec(0.1, 0.9, 11)            # tpot 80
    slow_e2e = _rec(0.1, 1.1, 31)             # tpot ~33, e2e 1100
    failed = _rec(0.01, 0.02, 2, ok=False)
    assert meets_slos(good, slos)
    assert not any(meets_slos(r, slos) for r in (slow_ttft, slow_tpot, slow_e2e, failed))
    records = [good, slow_ttft, slow_tpot, slow_e2e, failed]
    assert count_good(records, slos) == 1 and count_good(records, {"ttft": 200}) == 3
    m = aggregate(records, duration=0.5, slos=slos)
    assert m["good_requests"] == 1 and m["request_goodput"] == 2.0
    for bad in (["ttft"], ["itl:5"], ["tpot:-1"], ["e2el:abc"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrival_mean_and_determinism(burstiness: float) -> None:
    gaps = arrival_intervals(20_000, rate=8.0, burstiness=burstiness, seed=3)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert gaps == arrival_intervals(20_000, 8.0, burstiness, seed=3)
    assert min(gaps) >= 0.0


def test_burstiness_changes_spread() -> None:
    def cv(b: float) -> float:
        import numpy as np

        gaps = np.asarray(arrival_intervals(20_000, 4.0, b, seed=0))
        return float(gaps.std() / gaps.mean())

    assert cv(0.25) > cv(1.0) > cv(4.0)  # gamma: cv = 1/sqrt(shape)
    assert cv(1.0) == pytest.approx(1.0, rel=0.05)


def test_arrival_offsets() -> None:
    assert arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(50, 10.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    with pytest.raises(ValueError):
        arrival_intervals(3, 0.0)


def test_peak_concurrency() -> None:
    recs = [_rec(0, 1.0, 2, start=0.0), _rec(0, 1.0, 2, start=0.5), _rec(0, 1.0, 2, start=1.0)]
    assert peak_concurrency(recs) == 2  # the first ends as the third starts
    assert peak_concurrency([]) == 0


def test_random_requests_lengths() -> None:
    assert length_bounds(100, 0.2) == (80, 120) and length_bounds(1, 0.5) == (1, 1)
    specs = random_requests(200, 100, 10, 0.2, vocab_size=50, seed=0)
    assert all(80 <= len(s.prompt) <= 120 and 8 <= s.output_len <= 12 for s in specs)
    assert all(0 <= t < 50 for s in specs for t in s.prompt)
    assert {s.output_len for s in specs} == set(range(8, 13))
    assert specs == random_requests(200, 100, 10, 0.2, vocab_size=50, seed=0)
    fixed = random_requests(5, 7, 3, 0.0, 100, 1)
    assert all((len(s.prompt), s.output_len, s.prompt_len) == (7, 3, 7) for s in fixed)


def test_load_dataset(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hi", "output_len": 2}\n\n{"prompt": [5, 6], "output_len": 1}\n')
    specs = load_dataset(str(path), None)
    assert [(s.prompt, s.output_len, s.prompt_len) for s in specs] == [("hi", 2, None),
                                                                       ([5, 6], 1, 2)]
    assert len(load_dataset(str(path), 5)) == 5
    path.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="output_len"):
        load_dataset(str(path), None)


def test_sse_parsing() -> None:
    assert parse_sse_line(b"\n") is None and parse_sse_line(b": ping\n") is None
    assert parse_sse_line("data: [DONE]") is not None
    data = parse_sse_line(b'data: {"choices": [{"text": "a"}]}\n')
    assert chunk_text(data, chat=False) == "a"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, chat=True) is None
    # photon announces the role with empty content before the first token: not a token
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    assert chunk_text(role, chat=True) is None
    assert chunk_text({"choices": [{"delta": {"content": ""}}]}, chat=True) == ""  # a token
    assert chunk_text({"choices": [], "usage": {}}, chat=False) is None


# ---------------------------------------------------------------- speculative decoding

SPEC_METRICS = """\
# HELP photon:spec_decode_num_drafts_total Speculative rows that verified drafts.
# TYPE photon:spec_decode_num_drafts_total counter
photon:spec_decode_num_drafts_total{model_name="m"} 10.0
photon:spec_decode_num_drafts_created{model_name="m"} 1.7e9
photon:spec_decode_num_draft_tokens_total{model_name="m"} 25.0
photon:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0
photon:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 7.0
photon:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0
photon:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 4.0
photon:generation_tokens_total{model_name="m"} 99.0
"""


def test_spec_counters_are_parsed_and_subtracted() -> None:
    from photon.bench.serve_spec import parse_spec_counters, spec_delta_fields
    from photon.spec.stats import SpecDecodingStats

    after = parse_spec_counters(SPEC_METRICS)
    assert after == SpecDecodingStats(10, 25, 12, [7, 4, 1])
    vllm = parse_spec_counters(SPEC_METRICS.replace("photon:", "vllm:"))
    assert vllm == after  # vLLM's names
    assert parse_spec_counters("photon:generation_tokens_total 3.0\n") is None
    before = SpecDecodingStats(4, 8, 2, [2])  # fewer positions seen so far
    fields = spec_delta_fields(before, after)
    assert fields["spec_decode_num_drafts"] == 6 and fields["spec_decode_num_accepted_tokens"] == 10
    assert fields["spec_mean_acceptance_length"] == pytest.approx(1 + 10 / 6)
    assert fields["spec_acceptance_rate_per_pos"] == pytest.approx([5 / 6, 4 / 6, 1 / 6])
    assert spec_delta_fields(None, after)["spec_mean_acceptance_length"] is None


def test_no_spec_fields_without_server_counters(stub: tuple[str, StubState],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = stub
    s = _bench(capsys, "--base-url", url, "--num-prompts", "2", "--random-output-len", "3")
    assert s["spec_mean_acceptance_length"] is None and s["spec_decode_num_drafts"] is None


def test_acceptance_from_a_live_speculative_server(capsys: pytest.CaptureFixture[str]) -> None:
    """Two identical greedy runs against one server: each reports only its own counts (the same
    both times), and together they are the server's totals."""
    import httpx

    from photon.bench.serve_spec import parse_spec_counters
    from tests.server_util import live_server

    spec = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "adaptive": False}
    argv = ["--num-prompts", "4", "--random-input-len", "24", "--random-output-len", "12",
            "--warmup-requests", "0"]
    with live_server({"model": "photon-tiny-random", "speculative_config": spec}) as srv:
        runs = [_bench(capsys, "--base-url", srv.base_url, *argv) for _ in range(2)]
        total = parse_spec_counters(httpx.get(srv.base_url + "/metrics", timeout=30).text)
    keys = [k for k in runs[0] if k.startswith("spec_")]
    assert len(keys) == 5 and all(runs[0][k] == runs[1][k] for k in keys)
    first = runs[0]
    assert first["spec_decode_num_drafts"] > 0
    assert first["spec_decode_num_draft_tokens"] == first["spec_decode_num_drafts"]  # K = 1
    assert total is not None and total.num_drafts == 2 * first["spec_decode_num_drafts"]
    assert total.num_accepted_tokens == 2 * first["spec_decode_num_accepted_tokens"]
    accepted = first["spec_decode_num_accepted_tokens"]
    assert first["spec_mean_acceptance_length"] == pytest.approx(
        1 + accepted / first["spec_decode_num_drafts"])
    assert first["spec_acceptance_rate_per_pos"] == pytest.approx(
        [accepted / first["spec_decode_num_drafts"]])


def test_counters_are_read_once_they_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's closing read waits until two reads agree: counts the server adds after the
    last response (steps still in flight then) stay in this run's window."""
    import asyncio

    from photon.bench import serve_spec
    from photon.spec.stats import SpecDecodingStats

    reads = [SpecDecodingStats(3, 3, 1, [1]), SpecDecodingStats(4, 4, 2, [2]),
             SpecDecodingStats(4, 4, 2, [2]), SpecDecodingStats(9, 9, 9, [9])]
    calls = []

    async def fake(cfg: object) -> SpecDecodingStats:
        calls.append(cfg)
        return reads[len(calls) - 1]

    monkeypatch.setattr(serve_spec, "fetch_spec_counters", fake)
    got = asyncio.run(serve_spec.fetch_settled_spec_counters("cfg", interval_s=0.0))
    assert got == SpecDecodingStats(4, 4, 2, [2]) and len(calls) == 3

    async def none(cfg: object) -> None:
        calls.append(cfg)

    calls.clear()
    monkeypatch.setattr(serve_spec, "fetch_spec_counters", none)
    assert asyncio.run(serve_spec.fetch_settled_spec_counters("cfg", interval_s=0.0)) is None
    assert len(calls) == 1  # no counters (no speculation): no second read
