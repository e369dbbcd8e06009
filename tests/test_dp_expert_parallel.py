"""`--data-parallel-size 2 --enable-expert-parallel` on a tiny Qwen3-MoE: data-parallel attention,
the experts partitioned over the two engine cores, which step in lockstep (a core without work
runs dummy steps).

Greedy tokens equal one core without expert parallelism: requests on both cores finishing at
different steps, and a request alone on one core (the other only runs dummy steps); both cores
drain; a killed core makes the other fail with ExpertParallelError instead of hanging. The
lockstep protocol's state and the MoE layer's padded dispatch are checked without processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from photon.config import ConfigError, EngineConfig
from photon.distributed.dp_experts import DPExperts, ExpertParallelError, Round
from photon.distributed.group import TPGroup
from photon.engine import lockstep as lockstep_module
from photon.engine.async_engine import AsyncEngine, EngineDeadError, EngineUnavailableError
from photon.engine.async_llm import AsyncLLM
from photon.engine.lockstep import Lockstep
from photon.engine_args import EngineArgs
from photon.model.layers.moe import FusedMoE
from photon.sampling_params import SamplingParams
from tests.engine_pair import (
    Case,
    differences,
    engine_pair,
    run_cases,
    spy_core_assignment,
    wait_drained,
)
from tests.hf_models import QWEN3_MOE, make_engine_model
from tests.server_util import wait_until

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 20.0  # the cores' collective timeout: a dead core is noticed within it
WAIT_S = 60.0


def _config(path: str, dp: int, **kwargs: Any) -> EngineConfig:
    config = EngineArgs(model=path, max_model_len=128, max_num_seqs=8, data_parallel_size=dp,
                        enable_expert_parallel=dp > 1, structured_outputs_worker="inline",
                        **kwargs).create_config()
    parallel = dataclasses.replace(config.parallel, collective_timeout_s=TIMEOUT_S)
    return dataclasses.replace(config, parallel=parallel)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_engine_model(str(tmp_path_factory.mktemp("qwen3moe")), "Qwen3MoeForCausalLM",
                             extra=QWEN3_MOE)


@pytest.fixture(scope="module")
def pair(model_path: str) -> Iterator[tuple[AsyncEngine, AsyncLLM]]:
    """One core without expert parallelism (in process: the reference) and two lockstep cores."""
    with engine_pair(_config(model_path, 1), _config(model_path, 2)) as engines:
        assert engines[1].cores.lockstep
        yield engines


@pytest.fixture()
def assigned(pair: tuple[AsyncEngine, AsyncLLM], monkeypatch: pytest.MonkeyPatch
             ) -> dict[str, int]:
    """The core index each request of the lockstep engine was sent to (by caller's id)."""
    return spy_core_assignment(pair[1], monkeypatch)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _check_same(pair: tuple[AsyncEngine, AsyncLLM], cases: list[Case]) -> set[tuple[int, ...]]:
    """The lockstep engine gives every case the reference's output; every core drains. Returns
    the distinct token sequences."""
    want, got = run_cases(pair[0], cases), run_cases(pair[1], cases)
    for case in cases:
        assert not differences(want[case.request_id], got[case.request_id]), case.request_id
    wait_drained(pair[1])  # every core: no request, block or table row left
    assert pair[1].cores.loads == [0, 0]
    return {tuple(r.seq().token_ids) for r in got.values()}


def test_both_cores_finishing_apart_match_one_core(pair: tuple[AsyncEngine, AsyncLLM],
                                                   assigned: dict[str, int]) -> None:
    """Four requests of different lengths (prompts and outputs): two on each core, so each
    core's requests end at different steps and it runs dummy steps while the other finishes."""
    lengths = [3, 14, 6, 11]
    cases = [Case(f"g{i}", [7 + i, 100 + 3 * i, 5, 42, 9][:2 + i], _greedy(n))
             for i, n in enumerate(lengths)]
    cases.append(Case("s0", [11, 12, 13], SamplingParams(temperature=0.8, seed=5, max_tokens=9,
                                                         ignore_eos=True)))
    assert len(_check_same(pair, cases)) == len(cases)  # varied outputs: the check can fail
    assert set(assigned.values()) == {0, 1}, assigned


def test_blocking_lockstep_cores_match_one_core(pair: tuple[AsyncEngine, AsyncLLM],
                                                model_path: str) -> None:
    """The blocking loop (--no-pipelined) in lockstep: cores finishing apart, one of them on
    dummy steps, give the pipelined reference core's tokens."""
    lengths = [4, 12, 7]
    cases = [Case(f"b{i}", [9 + i, 200 + i, 3][:1 + i], _greedy(n))
             for i, n in enumerate(lengths)]
    cases.append(Case("bs", [21, 22], SamplingParams(temperature=0.8, seed=3, max_tokens=8,
                                                     ignore_eos=True)))
    blocking = AsyncLLM(_config(model_path, 2, pipelined=False))
    try:
        blocking.start()
        assert len(_check_same((pair[0], blocking), cases)) == len(cases)
    finally:
        blocking.shutdown()


def test_one_core_without_requests(pair: tuple[AsyncEngine, AsyncLLM],
                                   assigned: dict[str, int]) -> None:
    """One request: core 0 runs it, core 1 has none and runs only dummy steps; then both idle
    and wake again for the next request."""
    _check_same(pair, [Case("solo", [300, 301, 302, 303], _greedy(12))])
    _check_same(pair, [Case("again", [5, 6], _greedy(5))])
    assert assigned == {"solo": 0, "again": 0}


async def _until_error(engine: AsyncLLM, request_id: str, started: asyncio.Event
                       ) -> BaseException | None:
    try:
        async for _ in engine.generate([5, 6, 7], _greedy(110), request_id):
            started.set()
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e
    return None


def test_killed_core_fails_the_other(pair: tuple[AsyncEngine, AsyncLLM],
                                     caplog: pytest.LogCaptureFixture) -> None:
    """SIGKILL to core 1 while core 0 runs a request: core 0's next collective fails, it exits
    on its own with ExpertParallelError (within the collective timeout), the stream fails.
    Runs last: it ends the module's lockstep engine."""
    engine = pair[1]
    procs = [c.proc for c in engine.cores.clients]

    async def run() -> BaseException | None:
        started = asyncio.Event()
        task = asyncio.create_task(_until_error(engine, "k0", started))
        await started.wait()
        os.kill(procs[1].pid, signal.SIGKILL)
        return await task

    with caplog.at_level(logging.ERROR, logger="photon.engine.async_llm"):
        error = asyncio.run(asyncio.wait_for(run(), WAIT_S))
        assert isinstance(error, (EngineDeadError, EngineUnavailableError)), error
        procs[0].wait(TIMEOUT_S + 30)  # exits by itself: no hang
        wait_until(lambda: "ExpertParallelError" in caplog.text, "the cause is logged", 10)
    assert procs[0].returncode == 1
    assert "ExpertParallelError" in caplog.text and "did not answer within" in caplog.text
    assert engine.dead.wait(10) and not engine.healthy
    engine.shutdown()
    assert all(p.returncode is not None for p in procs)  # both reaped


# ---- without processes ------------------------------------------------------------------------
class _FakeExperts:
    """DPExperts' agreement and forward count, scripted."""

    def __init__(self, rounds: list[Round]) -> None:
        self.rounds = rounds
        self.num_forwards = 0

    def agree(self, has_work: bool, wakeups: int, stopping: bool) -> Round:
        return self.rounds.pop(0)


def test_lockstep_waits_and_dummy_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    dummies: list[object] = []
    monkeypatch.setattr(lockstep_module, "dummy_forward", dummies.append)
    experts = _FakeExperts([Round(True, 1, 2, False), Round(False, 1, 2, False),
                            Round(False, 2, 2, False)])
    lock = Lockstep(experts, "runner")  # type: ignore[arg-type]
    assert lock.must_wait(0) and not lock.must_wait(1)  # idle at start until a wake-up
    lock.agree(True, 1, False)
    assert not lock.must_wait(1)  # work: the next round follows at once
    lock.agree(False, 1, False)  # no work, a wake-up on its way to this core
    assert lock.must_wait(1) and not lock.must_wait(2)
    lock.agree(False, 2, False)  # settled: idle until the next wake-up
    assert lock.must_wait(2) and not lock.must_wait(3)

    def real_step() -> list[Any]:
        experts.num_forwards += 1
        return ["out"]

    assert lock.step(real_step) == ["out"] and dummies == []
    assert lock.step(list) == [] and dummies == ["runner"]  # no forward: a dummy one

    def two() -> list[Any]:
        experts.num_forwards += 2
        return []

    with pytest.raises(RuntimeError, match="lockstep broken"):
        lock.step(two)


def test_padded_dispatch_equals_the_plain_layer() -> None:
    """A core's tokens padded to the forward's agreed count: the pad rows route nowhere and the
    core's rows equal the plain layer's (one core: the collectives are the identity)."""
    torch.manual_seed(0)
    plain = FusedMoE(8, 2, 16, 24, renormalize=True)
    for p in plain.parameters():
        p.data.normal_()
    experts = DPExperts(TPGroup.single(), TIMEOUT_S)
    spread = FusedMoE(8, 2, 16, 24, renormalize=True, dp_experts=experts)
    spread.load_state_dict(plain.state_dict())
    x, logits = torch.randn(5, 16), torch.randn(5, 8)
    experts.begin_forward(5)
    experts.padded = 9  # as if another core ran 9 tokens
    xs, weights, ids = experts.dispatch(x, *torch.topk(torch.rand(5, 2), 2))
    assert xs.shape == (9, 16) and bool((ids[5:] == -1).all()) and not weights[5:].any()
    assert torch.allclose(spread(x, logits), plain(x, logits), atol=1e-6)
    assert experts.num_forwards == 1


def test_group_failure_is_expert_parallel_error() -> None:
    def broken() -> None:
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(ExpertParallelError, match=r"did not answer within 20 s; this core"):
        DPExperts(TPGroup.single(), TIMEOUT_S)._guard(broken)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tensor_parallel_size": 2}, r"tensor_parallel_size \(--tensor-parallel-size\)=2 is not "
                                  r"supported with it yet"),
    ({"data_parallel_size": 16}, "num_experts=8, fewer experts than cores"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     r"speculative_config \(--speculative-config\) is not supported with"),
])
def test_config_errors(model_path: str, kwargs: dict[str, Any], message: str) -> None:
    args = {"model": model_path, "data_parallel_size": 2, "enable_expert_parallel": True,
            **kwargs}
    with pytest.raises(ConfigError, match=message):
        EngineArgs(**args).create_config()


def test_dense_model_refused() -> None:
    with pytest.raises(ConfigError, match="ForCausalLM has no experts"):
        EngineArgs(model="photon-tiny-random", data_parallel_size=2,
                   enable_expert_parallel=True).create_config()
