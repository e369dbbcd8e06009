"""Preemption, pipelined/blocking parity and the serializable step contract, checked with the
real scheduler and a model-free runner (tests/fake_runner.py)."""

from __future__ import annotations

import msgspec
import pytest

from photon.core.sampling import PackedSampling
from photon.core.step import CommittedToken, PromptScores, StepPlan
from tests.fake_runner import EOS, Harness, make_request, mixed_workload

# Prompt lengths; 6 outputs each. With 8 usable blocks of 4 tokens, every request holds 2
# blocks after step 4 and 'a' (first admitted) finds no free block for its third while planning
# step 5: the victim is 'd', the last running request (not 'b', the next one).
FOUR = {"a": 4, "b": 2, "c": 2, "d": 2}


def _four(depth: int, num_blocks: int, prefix_caching: bool = False) -> Harness:
    h = Harness(depth, num_blocks=num_blocks, prefix_caching=prefix_caching)
    for seed, (rid, plen) in enumerate(FOUR.items(), start=1):
        h.add(make_request(rid, list(range(10 * seed, 10 * seed + plen)), 6, seed=seed))
    h.drain()
    h.assert_drained()
    return h


def _outputs(h: Harness) -> dict[str, tuple[list[int], str]]:
    return {rid: (r.output_token_ids, r.finish_reason.value) for rid, r in h.requests.items()}


def _check_victims(h: Harness) -> list[str]:
    """Every victim is the last running request (the lowest priority: the latest admitted, or the
    requester itself when none comes after it), preempted with its step still in flight and freed
    only once that step committed (the harness asserts inflight_refs == 0 at every free)."""
    victims = []
    for pos, ev in enumerate(h.log):
        if ev[0] == "preempt":
            _, rid, running, refs = ev
            assert running[-1] == rid, f"victim {rid} is not the last of {running}"
            if refs > 0:  # freed later, inside the commit that drops its last reference
                free = h.log.index(("free", rid), pos)
                loop = [e[0] for e in h.log if e[0] not in ("free", "preempt")]
                done = sum(e[0] not in ("free", "preempt") for e in h.log[:free])
                assert loop[done - 1:done + 1] == ["wait", "commit"]
            victims.append(rid)
    return victims


@pytest.mark.parametrize("depth", [2, 1])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_request_is_readmitted_with_its_committed_tokens(
        depth: int, prefix_caching: bool) -> None:
    h = _four(depth, num_blocks=9, prefix_caching=prefix_caching)
    d, plans = h.requests["d"], h.runner.raw_plans
    index = plans[0].new_requests[3].req_index
    assert [e for e in h.log if e[0] == "preempt"] == [("preempt", "d", ("a", "b", "c", "d"), 1)]
    assert _check_victims(h) == ["d"]
    # 'a' waits a step for the blocks: step 5 holds only 'b' and 'c'.
    assert plans[5].step == 5 and [r.req_index for r in plans[5].rows] == [1, 2]
    # 'd''s row of step 4 is in flight: it still commits its token (output 4), and its blocks
    # come back at commit(4); the runner learns the release from the next plan.
    assert max(p.step for p in plans if any(r.req_index == index for r in p.rows)) == 4
    assert h.log.index(("wait", 4)) < h.log.index(("free", "d")) < h.log.index(("commit", 4))
    assert plans[6].step == 6 and plans[6].released == [index]
    # Readmitted (FCFS, once blocks are free) by a new NewRequest: prompt + its 5 committed
    # outputs, at a free index (the fake asserts it), recomputed up to there, sampling output 5.
    new, plan = next((n, p) for p in plans[1:] for n in p.new_requests)
    assert new.token_ids == d.prompt_token_ids + d.output_token_ids[:5]
    assert new.sampling == d.sampling
    row = next(r for r in plan.rows if r.req_index == new.req_index)
    assert (row.seq_len, row.sample, row.out_index) == (7, True, 5)
    assert row.start == (4 if prefix_caching else 0)  # its first block is still cached
    assert d.num_preemptions == 1 and h.sched.num_preemptions == 1
    # The same tokens as a run with blocks to spare, which preempts nothing.
    roomy = _four(depth, num_blocks=64, prefix_caching=prefix_caching)
    assert roomy.sched.num_preemptions == 0
    assert _outputs(h) == _outputs(roomy)
    assert all(len(r.output_token_ids) == 6 for r in h.requests.values())


@pytest.mark.parametrize("depth", [2, 1])
def test_requester_waits_for_the_blocks_of_its_in_flight_victim(depth: int) -> None:
    """'a' and 'c' decode with 5 usable blocks. Planning step 4, 'a' needs a block: 'c' is the
    victim, but its row of step 3 is in flight, so 'a' waits a step (an empty plan). Nothing
    being staged, the next call plans again before committing step 3, still without the blocks:
    'a' must keep waiting for 'c''s blocks (they come back at commit(3)), not preempt itself
    too: one shortage, one preemption."""
    h = Harness(depth, num_blocks=6, prefix_caching=False)
    a = h.add(make_request("a", list(range(10, 15)), 8, seed=1))
    c = h.add(make_request("c", list(range(30, 36)), 8, seed=2))
    h.drain()
    h.assert_drained()
    assert _outputs(h) == {"a": (a.output_token_ids, "length"), "c": (c.output_token_ids, "length")}
    assert len(a.output_token_ids) == len(c.output_token_ids) == 8
    assert [e[1] for e in h.log if e[0] == "preempt"] == ["c"], \
        "'a' preempted itself while its victim's blocks were on their way back"
    assert a.num_preemptions == 0


# ---- pipelined and blocking plan the same steps ------------------------------------------------
def _run_mixed(depth: int) -> Harness:
    w = mixed_workload()
    h = w.harness(depth)
    h.run(w.arrivals, w.aborts)
    h.assert_drained()
    return h


def test_pipelined_and_blocking_plan_the_same_steps() -> None:
    pipelined, blocking = _run_mixed(2), _run_mixed(1)
    assert pipelined.runner.plans == blocking.runner.plans
    assert _outputs(pipelined) == _outputs(blocking)
    assert pipelined.zombie_rows == blocking.zombie_rows
    marks = ("preempt", "free")
    assert [e for e in pipelined.log if e[0] in marks] == [e for e in blocking.log if e[0] in marks]
    # The workload covers what it claims.
    h, reqs = pipelined, pipelined.requests
    plans = h.runner.raw_plans
    assert any(not r.sample for p in plans for r in p.rows)  # chunked prefill
    assert reqs["b"].output_token_ids[-1] == EOS and reqs["b"].finish_reason.value == "stop"
    assert reqs["f"].stop_reason == 7 and reqs["f"].finish_reason.value == "stop"
    assert reqs["d"].finish_reason.value == "abort" and h.zombie_rows.get("d", 0) > 0
    assert _check_victims(h) and h.sched.num_preemptions >= 2
    readmitted = [n for p in plans for n in p.new_requests if len(n.token_ids) > n.sampling.ints[2]]
    assert readmitted  # a preempted request came back with outputs
    for rid in ("a", "c", "e"):
        assert len(reqs[rid].output_token_ids) == reqs[rid].max_tokens


# ---- the contract is serializable ---------------------------------------------------------------
def _roundtrip(value: object, type_: object) -> object:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=type_)


def test_step_plan_round_trips_through_msgpack() -> None:
    h = _run_mixed(2)
    plan = next(p for p in h.runner.raw_plans if p.rows and p.new_requests and p.released)
    decoded = _roundtrip(plan, StepPlan)
    assert decoded == plan and decoded is not plan
    assert isinstance(decoded.new_requests[0].sampling, PackedSampling)
    assert decoded.new_requests[0].sampling.floats == plan.new_requests[0].sampling.floats
    assert [r.seq_len for r in decoded.rows] == [r.seq_len for r in plan.rows]
    for p in h.runner.raw_plans:  # every plan of the run, empty ones included
        assert _roundtrip(p, StepPlan) == p


def test_step_results_round_trip_through_msgpack() -> None:
    tokens = [[CommittedToken(5)], [],
              [CommittedToken(7, logprob=-0.25, rank=2, top_ids=[3, 7], top_logprobs=[-0.5, -0.25]),
               CommittedToken(8)]]
    assert _roundtrip(tokens, list[list[CommittedToken]]) == tokens
    scores = [PromptScores(3, 1, [-1.5, -0.125], [4, 1], [[9], [2]], [[-0.5], [-0.125]]),
              PromptScores(0, 0, [-2.0], [7], [[]], [[]])]
    assert _roundtrip(scores, list[PromptScores]) == scores


@pytest.mark.parametrize("depth", [2, 1])
def test_a_finishing_requests_successor_starts_in_the_next_plan(depth: int) -> None:
    """Two at a time: 'a' (2 outputs) ends while 'b' (6) runs and 'c' waits. The plan made while
    a's last output is still in flight admits 'c' (a plans no more rows): no step runs 'b'
    alone, and 'c' holds a request index of its own while 'a' still holds one."""
    h = Harness(depth, max_num_seqs=2)
    for seed, (rid, n) in enumerate({"a": 2, "b": 6, "c": 3}.items(), start=1):
        h.add(make_request(rid, [10 * seed, 10 * seed + 1], n, seed=seed))
    h.drain()
    h.assert_drained()
    plans = h.runner.raw_plans
    assert [len(p.rows) for p in plans[:4]] == [2, 2, 2, 2]
    assert [len(p.new_requests) for p in plans[:3]] == [2, 0, 1]
    a_index = plans[0].new_requests[0].req_index
    assert plans[2].new_requests[0].req_index != a_index
    assert {rid: len(r.output_token_ids) for rid, r in h.requests.items()} == \
        {"a": 2, "b": 6, "c": 3}
