"""`--data-parallel-size 2`: two engine cores behind one front end (`AsyncLLM`).

Every request gets the tokens a single engine gives it (greedy, seeded sampling, n > 1); the
front end spreads requests over both cores by load, keeps an n > 1 request's children on one
core, sends aborts to the owning core, and a killed core ends the engine with the single-core
error. The offline LLM refuses data parallelism (it is `photon serve`'s).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from photon import LLM
from photon.cli import build_parser, main
from photon.config import ConfigError
from photon.engine.async_engine import AsyncEngine, EngineDeadError, EngineUnavailableError
from photon.engine.async_llm import AsyncLLM
from photon.engine.core_group import CoreGroup, visible_devices_for
from photon.engine.messages import Abort
from photon.engine_args import EngineArgs
from photon.sampling_params import SamplingParams
from tests.engine_pair import (
    Case,
    differences,
    engine_pair,
    run_cases,
    spy_core_assignment,
    wait_drained,
)
from tests.serve_process import cmdline, serve_process, wait_all_gone
from tests.server_util import TINY_ARGS, api_server_count

PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time", "In the beginning",
           "def main():", "Dear diary, today"]
WAIT_S = 120.0


def _config(dp: int) -> Any:
    return EngineArgs(**{**TINY_ARGS, "data_parallel_size": dp}).create_config()


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[AsyncEngine, AsyncLLM]]:
    """The single in-process engine (the reference) and a DP=2 AsyncLLM."""
    with engine_pair(_config(1), _config(2)) as engines:
        yield engines


@pytest.fixture()
def assigned(pair: tuple[AsyncEngine, AsyncLLM], monkeypatch: pytest.MonkeyPatch
             ) -> dict[str, int]:
    """The core index each request of the DP=2 engine was sent to (by caller's id)."""
    return spy_core_assignment(pair[1], monkeypatch)


def _ids(pair: tuple[AsyncEngine, AsyncLLM], text: str) -> list[int]:
    return pair[1].frontend.tokenizer.encode(text)


def _check_same(pair: tuple[AsyncEngine, AsyncLLM], cases: list[Case]) -> None:
    want = run_cases(pair[0], cases)
    got = run_cases(pair[1], cases)
    for engine in pair:
        wait_drained(engine)
    for case in cases:
        assert not differences(want[case.request_id], got[case.request_id]), case.request_id
        assert sorted(got[case.request_id].sequences) == list(range(case.params.n))
    assert pair[1].cores.loads == [0, 0]


def test_greedy_and_seeded_match_one_engine(pair: tuple[AsyncEngine, AsyncLLM],
                                            assigned: dict[str, int]) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cases = [Case(f"g{i}", _ids(pair, p), greedy) for i, p in enumerate(PROMPTS)]
    cases += [Case(f"s{i}", _ids(pair, p), SamplingParams(
        temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=16, ignore_eos=True))
        for i, p in enumerate(PROMPTS)]
    _check_same(pair, cases)
    assert set(assigned.values()) == {0, 1}, assigned  # both cores served requests
    stats = pair[1]._stats
    assert all(s is not None and s.prefix_queries > 0 for s in stats), stats


def test_n_children_stay_on_one_core(pair: tuple[AsyncEngine, AsyncLLM],
                                     assigned: dict[str, int]) -> None:
    cases = [Case(f"n{i}", _ids(pair, p), SamplingParams(
        n=3, temperature=0.9, seed=7 * i, max_tokens=12, ignore_eos=True))
        for i, p in enumerate(PROMPTS[:4])]
    _check_same(pair, cases)
    assert sorted(assigned) == [c.request_id for c in cases]  # one core per request
    assert set(assigned.values()) == {0, 1}


async def _first_then_abort(engine: AsyncLLM, request_id: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async for _ in engine.generate([5, 6, 7], params, request_id):
        return  # leaving the stream aborts the request


def test_abort_goes_to_the_owning_core(pair: tuple[AsyncEngine, AsyncLLM],
                                       assigned: dict[str, int],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    engine = pair[1]
    sent: list[tuple[int, Abort]] = []
    for index, client in enumerate(engine.cores.clients):
        real = client.send

        def spy(msg: Any, index: int = index, real: Any = real) -> None:
            if isinstance(msg, Abort):
                sent.append((index, msg))
            real(msg)

        monkeypatch.setattr(client, "send", spy)

    async def both() -> None:
        await asyncio.gather(_first_then_abort(engine, "a0"), _first_then_abort(engine, "a1"))

    asyncio.run(asyncio.wait_for(both(), WAIT_S))
    wait_drained(engine)
    assert assigned == {"a0": 0, "a1": 1}
    owners = {msg.request_ids[0].rsplit("#", 1)[0]: index for index, msg in sent}
    assert owners == {"a0": 0, "a1": 1}, sent
    assert engine.cores.loads == [0, 0]


def test_least_loaded_core_ties_by_index() -> None:
    cores = CoreGroup([object(), object(), object()])  # type: ignore[list-item]
    picks = [cores.clients.index(cores.assign(f"r{i}")) for i in range(4)]
    assert picks == [0, 1, 2, 0]
    cores.release("r1")
    cores.release("r1")  # twice: ignored
    assert cores.loads == [2, 0, 1]
    assert cores.clients.index(cores.assign("r4")) == 1
    assert cores.owner("r2") is cores.clients[2] and cores.owner("r1") is None


def test_gpus_per_core() -> None:
    assert [visible_devices_for(list("0123"), 2, 2, r) for r in (0, 1)] == ["0,1", "2,3"]
    with pytest.raises(ConfigError, match="needs 4 GPUs; 2 are visible"):
        visible_devices_for(["0", "1"], 2, 2, 0)


def test_config_and_offline_llm_refuses() -> None:
    with pytest.raises(ConfigError, match="data_parallel_size must be a positive integer"):
        _config(0)
    with pytest.raises(ConfigError, match="photon serve --data-parallel-size 2"):
        LLM(**{**TINY_ARGS, "data_parallel_size": 2})
    parser = build_parser()
    ns = parser.parse_args(["serve", "-dp", "2"])
    assert ns.data_parallel_size == 2 and _config(ns.data_parallel_size).parallel \
        .data_parallel_size == 2


def test_serve_refuses_dp_with_several_api_servers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--model", "photon-tiny-random", "--max-model-len", "256", "-dp", "2",
            "--api-server-count", "2", "--port", "0"]
    assert main(argv) == 2
    assert "--api-server-count > 1 with --data-parallel-size > 1" in capsys.readouterr().err


async def _until_error(engine: AsyncLLM, request_id: str, started: asyncio.Event
                       ) -> BaseException | None:
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
    try:
        async for _ in engine.generate([5, 6, 7], params, request_id):
            started.set()
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e
    return None


def test_a_killed_core_ends_the_engine() -> None:
    """SIGKILL to core 1 while both run a request: both streams fail with the single-core
    error, `dead` is set, later requests are refused, and shutdown reaps both cores."""
    engine = AsyncLLM(_config(2))
    procs = [c.proc for c in engine.cores.clients]
    try:
        engine.start()

        async def run() -> list[BaseException | None]:
            events = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(_until_error(engine, f"k{i}", events[i]))
                     for i in range(2)]
            await asyncio.gather(*(e.wait() for e in events))
            os.kill(procs[1].pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

        errors = asyncio.run(asyncio.wait_for(run(), WAIT_S))
        for error in errors:
            assert isinstance(error, EngineDeadError), error
            assert "the engine core process was killed by SIGKILL" in str(error)
        assert engine.dead.wait(30) and not engine.healthy
        with pytest.raises(EngineUnavailableError, match="killed by SIGKILL"):
            asyncio.run(_raise_first(engine))
    finally:
        engine.shutdown()
    assert all(p.returncode is not None for p in procs)


async def _raise_first(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    async for _ in engine.generate([5, 6], params, "later"):
        pass


@pytest.mark.skipif(api_server_count() > 1, reason="one API server with --data-parallel-size")
def test_serve_with_two_cores() -> None:
    """`photon serve --data-parallel-size 2`: two engine-core processes; concurrent greedy
    completions give the offline engine's texts."""
    prompts = PROMPTS[:4]
    llm = LLM(**TINY_ARGS)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    with serve_process("--data-parallel-size", "2", "--max-model-len", "256",
                       "--max-num-seqs", "32") as server:
        cores = [p for p in server.descendants() if "photon.engine.core_proc" in cmdline(p.pid)]
        assert len(cores) == 2
        body = {"model": "photon-tiny-random", "prompt": prompts, "max_tokens": 12,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        got = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        assert got == want
    wait_all_gone(cores)
