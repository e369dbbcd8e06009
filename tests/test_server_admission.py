"""Admission control: sequences (prompts x n) are counted when a request is admitted, so
requests arriving together see each other, and a request that could never fit is a 400.

The engine is held before each step (`engine_paused`), so admitted requests stay in flight
until the test lets them run: what is admitted does not depend on timing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from photon.cli import build_parser
from photon.server.admission import Admission, SharedCount
from photon.server.errors import APIError
from photon.server.launch import server_config
from tests.server_util import LiveServer, engine_paused, live_server, wait_drained, wait_until

MAX_RUNNING, MAX_QUEUED = 2, 2  # at most 4 sequences held at once
BODY = {"prompt": "go", "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server({"max_num_seqs": MAX_RUNNING}, max_queued_requests=MAX_QUEUED,
                     max_prompts_per_request=4) as s:
        yield s


@pytest.fixture()
def admission(server: LiveServer) -> Iterator[Admission]:
    admission = server.admission
    yield admission
    wait_until(lambda: admission.in_flight == 0, "every admitted sequence is released")
    wait_drained(server.engine)


def post(server: LiveServer, **fields: Any) -> httpx.Response:
    return httpx.post(server.api_url + "/completions", json={**BODY, **fields}, timeout=60)


def test_in_flight_sequences_are_counted(server: LiveServer, admission: Admission) -> None:
    with engine_paused(server.engine) as gate, ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, server, n=3)
        wait_until(lambda: admission.in_flight == 3, "the n=3 request is admitted")
        full = post(server, n=2)  # 3 + 2 > 4, though the engine has not stepped yet
        assert full.status_code == 429, full.text
        assert full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "too_many_queued_requests"
        second = pool.submit(post, server)  # 3 + 1 fits
        wait_until(lambda: admission.in_flight == 4, "the n=1 request is admitted")
        assert post(server).status_code == 429
        gate.set()
        assert [_ok(f) for f in (first, second)] == [3, 1]


def _ok(fut: Future[httpx.Response]) -> int:
    r = fut.result(timeout=60)
    assert r.status_code == 200, r.text
    return len(r.json()["choices"])


async def _burst(server: LiveServer, admission: Admission, gate: Any, size: int) -> list[int]:
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = [asyncio.create_task(client.post(server.api_url + "/completions", json=BODY))
                 for _ in range(size)]
        deadline = asyncio.get_running_loop().time() + 30
        while sum(t.done() for t in tasks) < size - MAX_RUNNING - MAX_QUEUED:
            assert asyncio.get_running_loop().time() < deadline, "the rejections did not come"
            await asyncio.sleep(0.01)
        assert admission.in_flight == MAX_RUNNING + MAX_QUEUED
        gate.set()
        return sorted(r.status_code for r in await asyncio.gather(*tasks))


def test_concurrent_burst_admits_exactly_the_capacity(server: LiveServer,
                                                      admission: Admission) -> None:
    with engine_paused(server.engine) as gate:
        statuses = asyncio.run(_burst(server, admission, gate, 10))
    assert statuses == [200] * 4 + [429] * 6


@pytest.fixture(scope="module")
def two_servers() -> Iterator[LiveServer]:
    with live_server({"max_num_seqs": MAX_RUNNING}, api_servers=2,
                     max_queued_requests=MAX_QUEUED) as s:
        yield s


def test_two_api_servers_admit_the_servers_capacity_together(two_servers: LiveServer) -> None:
    """--api-server-count 2: the limit is the whole server's, wherever connections land."""
    with engine_paused(two_servers.engine) as gate:
        statuses = asyncio.run(_burst(two_servers, two_servers.admission, gate, 10))
    assert statuses == [200] * 4 + [429] * 6
    wait_until(lambda: two_servers.admission.in_flight == 0, "every sequence is released")


def test_api_servers_share_one_count(tmp_path: Any) -> None:
    """Two servers' admissions on one shared count: each sees what the other admitted."""
    path = str(tmp_path / "admission")
    SharedCount.create(path)
    first, second = (Admission(MAX_RUNNING, MAX_QUEUED, path) for _ in range(2))
    held = first.admit(3)
    with pytest.raises(APIError) as full:
        second.admit(2)
    assert full.value.status == 429 and "1 sequences queued, limit 2" in str(full.value)
    other = second.admit(1)
    assert (first.in_flight, second.in_flight) == (4, 4)
    held.release_all()
    other.release(1)
    assert (first.in_flight, second.in_flight) == (0, 0)


def test_request_larger_than_capacity_is_400(server: LiveServer, admission: Admission) -> None:
    r = post(server, prompt=["a", "b", "c"], n=2)  # 6 sequences can never fit 4
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "n" and "6 sequences (3 prompts x n=2)" in err["message"], err
    r = post(server, prompt=[[1, 2]] * 5)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and "5 prompts" in err["message"], err
    assert "at most 4" in err["message"]
    r = httpx.post(server.api_url + "/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "n": 5, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_failed_and_abandoned_requests_release_their_sequences(
        server: LiveServer, admission: Admission) -> None:
    bad_regex = post(server, n=4, structured_outputs={"regex": "("})  # fails after admission
    assert bad_regex.status_code == 400, bad_regex.text
    assert admission.in_flight == 0
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 4, "stream": True}
    with engine_paused(server.engine):
        with httpx.stream("POST", server.api_url + "/chat/completions", json=chat,
                          timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # (a dropped iterator would close the connection)
            assert next(lines).startswith("data: ")  # the role chunk comes before any token
            assert admission.in_flight == 4
        # hung up mid-stream; no token has been made, so only the hang-up can release them
        wait_until(lambda: admission.in_flight == 0, "the hang-up releases the sequences")


def test_serve_flags() -> None:
    ns = build_parser().parse_args(["serve", "--max-queued-requests", "7",
                                    "--max-prompts-per-request", "3"])
    config = server_config(ns, "m", 64)
    assert (config.max_queued_requests, config.max_prompts_per_request) == (7, 3)
    ns = build_parser().parse_args(["serve", "--max-prompts-per-request", "0"])
    with pytest.raises(ValueError, match="--max-prompts-per-request must be >= 1"):
        server_config(ns, "m", 64)
