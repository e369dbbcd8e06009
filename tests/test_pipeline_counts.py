"""A request's `inflight_refs` and `num_pending` between two `Pipeline.step()` calls, and where
inside a call they change, at depth 1 and depth 2 (docs/architecture.md, section 4).

Between calls both loops hold one launched step (t+1) and one planned and staged step (t+2), so a
decoding request has two rows in flight at either depth: commit(t) drops both counters to 1 and
plan(t+2) raises them back to 2."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from photon import LLM, SamplingParams
from photon.core.step import CommittedToken
from photon.engine.engine_core import EngineCore
from photon.engine.request import Request
from photon.engine.scheduler import SchedulerOutput

Counts = tuple[int, int]  # (inflight_refs, num_pending)


@dataclass
class CountLog:
    """Records one request's counters after every step() call and around every plan and commit
    inside it."""

    req: Request | None = None
    calls: list[Counts] = field(default_factory=list)
    phases: list[list[tuple[str, Counts, Counts]]] = field(default_factory=list)

    def counts(self) -> Counts:
        return self.req.inflight_refs, self.req.num_pending

    def install(self, core: EngineCore) -> None:
        sched = core.scheduler
        orig_plan, orig_commit = sched.plan, sched.commit

        def plan() -> SchedulerOutput:
            before = self.counts()
            out = orig_plan()
            self.phases[-1].append(("plan", before, self.counts()))
            return out

        def commit(step: SchedulerOutput, tokens: list[list[CommittedToken]],
                   ended: frozenset[int] = frozenset()) -> list[Request]:
            before = self.counts()
            touched = orig_commit(step, tokens, ended)
            self.phases[-1].append(("commit", before, self.counts()))
            return touched

        sched.plan, sched.commit = plan, commit

    def step(self, core: EngineCore) -> None:
        self.phases.append([])
        core.step()
        self.calls.append(self.counts())


def _engine(pipelined: bool, budget: int = 64) -> EngineCore:
    llm = LLM("photon-tiny-random", pipelined=pipelined, max_model_len=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=budget)
    assert llm.engine.pipeline.depth == (2 if pipelined else 1)
    return llm.engine


def _start(core: EngineCore, prompt_len: int, max_tokens: int) -> CountLog:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(list(range(3, 3 + prompt_len)), params, request_id="a")
    log = CountLog(core.parents["a"][0])
    log.install(core)
    return log


@pytest.mark.parametrize("pipelined", [False, True])
def test_decoding_request_has_two_rows_in_flight_between_calls(pipelined: bool) -> None:
    core = _engine(pipelined)
    log = _start(core, prompt_len=6, max_tokens=6)
    for _ in range(20):
        if not core.has_unfinished():
            break
        log.step(core)
        if log.calls[-1] == (2, 2):  # steady decode: one launched step, one staged step
            assert len(core.pipeline.inflight) == 1 and core.pipeline.staged is not None
    # Six outputs: rows for outputs 0..5 are planned two ahead of their commits; once the last
    # output is planned no row is added, and the last commit leaves nothing in flight.
    assert log.calls == [(2, 2)] * 5 + [(1, 1), (0, 0)]
    assert log.req.req_index is None and len(log.req.output_token_ids) == 6
    # The first call plans twice (nothing was staged): the prefill row, then the first decode.
    assert log.phases[0] == [("plan", (0, 0), (1, 1)), ("plan", (1, 1), (2, 2))]
    # Every steady call: commit(t) drops a row, plan(t+2) adds one (launch and sample do not
    # touch the counters); the same order of plan and commit at both depths.
    for phases in log.phases[1:5]:
        assert phases == [("commit", (2, 2), (1, 1)), ("plan", (1, 1), (2, 2))]
    assert log.phases[5] == [("commit", (2, 2), (1, 1)), ("plan", (1, 1), (1, 1))]


@pytest.mark.parametrize("pipelined", [False, True])
def test_prompt_chunks_count_in_inflight_refs_not_in_num_pending(pipelined: bool) -> None:
    """A 10-token prompt at a budget of 4 tokens a step: chunks of 4, 4, then 2 that samples."""
    core = _engine(pipelined, budget=4)
    log = _start(core, prompt_len=10, max_tokens=8)
    for _ in range(4):
        log.step(core)
    assert log.calls == [(2, 0), (2, 1), (2, 2), (2, 2)]


@pytest.mark.parametrize("pipelined", [False, True])
def test_request_aborted_between_calls_is_released_two_commits_later(pipelined: bool) -> None:
    """Its launched row and its staged row both run as zombies; the second commit frees it."""
    core = _engine(pipelined)
    log = _start(core, prompt_len=6, max_tokens=16)
    for _ in range(3):
        log.step(core)
    assert log.calls[-1] == (2, 2)
    core.abort("a")
    log.step(core)
    assert log.calls[-1] == (1, 1) and log.req.finished and log.req.req_index is not None
    log.step(core)
    assert log.calls[-1] == (0, 0) and log.req.req_index is None
    assert not core.has_unfinished()
    core.assert_drained()
