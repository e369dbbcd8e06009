"""The pipeline's loop order, a request's counters between calls and zombie rows, checked with
the real scheduler and a model-free runner (tests/fake_runner.py) at depth 1 and depth 2."""

from __future__ import annotations

import pytest

from tests.fake_runner import EOS, Event, Harness, key_of, make_request, mixed_workload

STEADY = [("launch", 1), ("wait", 0), ("commit", 0), ("plan", 2), ("sample", 1)]

# One request, a 6-token prompt and 4 outputs: steps 0..3 (step 0 is the prefill), one call each
# and a last call that commits step 3 and hands its release to the runner.
EXPECTED_CALLS = {
    2: [[("plan", 0), ("launch", 0), ("plan", 1), ("sample", 0)],
        [("launch", 1), ("wait", 0), ("commit", 0), ("plan", 2), ("sample", 1)],
        [("launch", 2), ("wait", 1), ("commit", 1), ("plan", 3), ("sample", 2)],
        [("launch", 3), ("wait", 2), ("commit", 2), ("empty", ()), ("sample", 3)],
        [("empty", ()), ("wait", 3), ("free", "a"), ("commit", 3), ("empty", (0,))]],
    1: [[("plan", 0), ("launch", 0), ("sample", 0), ("sync", 0), ("plan", 1)],
        [("wait", 0), ("commit", 0), ("launch", 1), ("sample", 1), ("sync", 1), ("plan", 2)],
        [("wait", 1), ("commit", 1), ("launch", 2), ("sample", 2), ("sync", 2), ("plan", 3)],
        [("wait", 2), ("commit", 2), ("launch", 3), ("sample", 3), ("sync", 3), ("empty", ())],
        [("empty", ()), ("wait", 3), ("free", "a"), ("commit", 3), ("empty", (0,))]],
}


def _prompt(n: int) -> list[int]:
    return list(range(3, 3 + n))


@pytest.mark.parametrize("depth", [2, 1])
def test_loop_order_of_one_request(depth: int) -> None:
    h = Harness(depth)
    req = h.add(make_request("a", _prompt(6), 4, seed=1))
    h.drain()
    assert h.calls() == EXPECTED_CALLS[depth]
    assert len(req.output_token_ids) == 4
    h.assert_drained()


def _where(call: list[Event]) -> dict[Event, int]:
    return {ev: i for i, ev in enumerate(call) if ev[0] in ("plan", "launch", "wait", "commit",
                                                            "sample", "sync")}


def _check_call_order(depth: int, call: list[Event]) -> bool:
    """The order inside one call that commits a step t; True when it also launched t+1."""
    at = _where(call)
    t = next(ev[1] for ev in call if ev[0] == "commit")
    assert at[("wait", t)] < at[("commit", t)]
    if ("launch", t + 1) not in at:  # nothing to launch: nothing sampled either
        assert not any(ev[0] in ("launch", "sample") for ev in call)
        return False
    commit, launch, sample = at[("commit", t)], at[("launch", t + 1)], at[("sample", t + 1)]
    plans = [i for ev, i in at.items() if ev[0] == "plan" and i > commit]
    assert plans in ([], [at.get(("plan", t + 2))])  # only t+2 is planned after commit(t)
    if depth == 2:  # launch t+1, commit t, plan t+2, sample t+1; the wait is in commit
        assert launch < at[("wait", t)] and commit < sample
        assert all(commit < p < sample for p in plans)
        assert ("sync", t + 1) not in at
    else:  # commit t, launch t+1, sample t+1, sync t+1, plan t+2
        assert commit < launch < sample < at[("sync", t + 1)]
        assert all(at[("sync", t + 1)] < p for p in plans)
    return True


@pytest.mark.parametrize("depth", [2, 1])
def test_loop_order_on_a_mixed_workload(depth: int) -> None:
    """Every call that commits a step obeys the loop order, across arrivals, chunked prefills,
    stops, an abort, preemptions and idle gaps."""
    w = mixed_workload()
    h = w.harness(depth)
    h.run(w.arrivals, w.aborts)
    steady = [_check_call_order(depth, c) for c in h.calls() if any(e[0] == "commit" for e in c)]
    assert sum(steady) >= 15
    # Each step is launched, sampled and waited exactly once, in step order.
    for kind in ("launch", "sample", "wait", "commit"):
        assert [e[1] for e in h.log if e[0] == kind] == list(range(h.runner.next_step))
    h.assert_drained()


# ---- inflight_refs and num_pending between calls -------------------------------------------
def _counts_per_call(h: Harness, rid: str, calls: int) -> list[tuple[int, int]]:
    req, out = h.requests[rid], []
    for _ in range(calls):
        h.step()
        out.append((req.inflight_refs, req.num_pending))
        if out[-1] == (2, 2):  # one step launched (t+1) and one planned and staged (t+2)
            assert len(h.pipeline.inflight) == 1 and h.pipeline.staged is not None
    return out


@pytest.mark.parametrize("depth", [2, 1])
def test_decoding_request_has_two_rows_in_flight_between_calls(depth: int) -> None:
    h = Harness(depth)
    req = h.add(make_request("a", _prompt(6), 6, seed=1))
    assert _counts_per_call(h, "a", 7) == [(2, 2)] * 5 + [(1, 1), (0, 0)]
    assert req.req_index is None and len(req.output_token_ids) == 6
    h.drain()
    h.assert_drained()


@pytest.mark.parametrize("depth", [2, 1])
def test_prompt_chunks_count_in_inflight_refs_not_in_num_pending(depth: int) -> None:
    """A 10-token prompt at a budget of 4 tokens a step: chunks of 4, 4, then 2 that samples."""
    h = Harness(depth, budget=4)
    h.add(make_request("a", _prompt(10), 8, seed=1))
    assert _counts_per_call(h, "a", 4) == [(2, 0), (2, 1), (2, 2), (2, 2)]
    assert [p[1][0][1:4] for p in h.runner.plans[:3]] == [(0, 4, False), (4, 4, False),
                                                           (8, 2, True)]


# ---- zombie rows ------------------------------------------------------------------------------
def _index_of(h: Harness, rid: str) -> int:
    """The request index the runner got for `rid` (its first admission)."""
    prompt = tuple(h.requests[rid].prompt_token_ids)
    return next(n.req_index for p in h.runner.raw_plans for n in p.new_requests
                if tuple(n.token_ids) == prompt)


def _release_plan(h: Harness, index: int, after: int) -> int:
    """Position in the log of the first plan after log position `after` that releases `index`."""
    plans = iter(h.runner.plans)
    for pos, ev in enumerate(h.log):
        if ev[0] in ("plan", "empty"):
            plan = next(plans)
            if pos > after and index in plan[3]:
                return pos
    raise AssertionError(f"index {index} never released after log position {after}")


@pytest.mark.parametrize("depth", [2, 1])
def test_request_stopped_by_eos_runs_one_zombie_row(depth: int) -> None:
    """'a' samples EOS as its third output (committed at commit(2)); its row in step 3 is
    launched already: it runs and samples, its token is dropped, and 'a' is released at
    commit(3), when its last reference goes."""
    a = make_request("a", _prompt(6), 10, seed=1)
    h = Harness(depth, script={(key_of(a), 2): EOS})
    h.add(a)
    b = h.add(make_request("b", _prompt(4), 10, seed=2))
    h.drain()
    assert a.output_token_ids == [h.runner.token(key_of(a), j) for j in (0, 1)] + [EOS]
    assert a.finish_reason.value == "stop" and h.zombie_rows == {"a": 1}
    index = _index_of(h, "a")
    zombie = [r for r in h.runner.raw_plans[3].rows if r.req_index == index]
    assert h.runner.raw_plans[3].step == 3 and [(r.sample, r.out_index) for r in zombie] == \
        [(True, 3)]
    free = h.log.index(("free", "a"))
    assert h.log.index(("wait", 3)) < free < h.log.index(("commit", 3))
    assert h.log.index(("commit", 2)) < free  # finished at commit(2), not freed there
    # The runner learns it from the plan made right after commit(3) (b still runs: step 5).
    release = _release_plan(h, index, free)
    assert h.log[release] == ("plan", 5) and release > h.log.index(("commit", 3))
    assert len(b.output_token_ids) == 10 and EOS not in b.output_token_ids
    h.assert_drained()


@pytest.mark.parametrize("depth", [2, 1])
@pytest.mark.parametrize("alone", [True, False])
def test_request_aborted_between_calls_runs_two_zombie_rows(depth: int, alone: bool) -> None:
    """Aborted with a launched and a staged step: both rows run as zombies; the second commit
    frees it. Alone, its index reaches the runner in a releases-only plan."""
    h = Harness(depth)
    a = h.add(make_request("a", _prompt(6), 16, seed=1))
    if not alone:
        h.add(make_request("b", _prompt(5), 16, seed=2))
    for _ in range(3):
        h.step()
    assert (a.inflight_refs, a.num_pending) == (2, 2)
    index, outputs = a.req_index, list(a.output_token_ids)
    h.sched.abort(a)
    assert a.finished and a.req_index == index and index in h.runner.table
    h.step()
    assert (a.inflight_refs, a.req_index) == (1, index) and index in h.runner.table
    h.step()
    assert (a.inflight_refs, a.num_pending, a.req_index) == (0, 0, None)
    assert index not in h.runner.table  # delivered in the call that freed it
    release = _release_plan(h, index, h.log.index(("free", "a")))
    assert h.log[release][0] == ("empty" if alone else "plan")
    assert a.output_token_ids == outputs and h.zombie_rows == {"a": 2}
    h.drain()
    h.assert_drained()
