"""Pipelined (depth 2) and blocking (depth 1) plan identical schedules (the same rows, prefix-cache
hits and preemptions at every step) and give identical tokens and finish reasons, and the
zombie/release invariants hold: no token after finish, no release while in flight, all free
after drain."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from photon import LLM, SamplingParams
from photon.core.step import CommittedToken
from photon.engine.engine_core import EngineCore
from photon.engine.request import Request
from photon.engine.scheduler import SchedulerOutput
from photon.structured.step import NO_ENDS


@dataclass
class Spec:
    prompt: list[int]
    params: SamplingParams
    abort_after: int | None = None  # abort once this many tokens were observed


@dataclass
class Audit:
    """Wraps an engine's commit and free paths and checks the invariants as they happen."""

    core: EngineCore
    requests: dict[str, Request] = field(default_factory=dict)
    by_key: dict[int, Request] = field(default_factory=dict)  # the scheduler's key of each
    final_len: dict[str, int] = field(default_factory=dict)
    zombie_rows: int = 0
    releases: int = 0
    # Every plan: (request id, first position, tokens, samples) per row; the first row of an
    # admitted request starts at its prefix-cache hit.
    schedule: list[tuple[tuple[str, int, int, bool], ...]] = field(default_factory=list)
    # Aligned with `schedule`: per row, the drafts it verifies if it is a speculative row, else
    # None (a plain row: positions from the host).
    row_spec: list[tuple[int | None, ...]] = field(default_factory=list)
    spec_k: list[int] = field(default_factory=list)  # aligned with `schedule`: each plan's K_eff

    def install(self) -> None:
        sched, kv = self.core.scheduler, self.core.kv
        orig_commit, orig_free, orig_add, orig_plan = sched.commit, kv.free, sched.add, sched.plan

        def plan() -> SchedulerOutput:
            out = orig_plan()
            self.schedule.append(tuple((q.request_id, r.start, r.num_tokens, r.sample)
                                       for r, q in zip(out.plan.rows, out.requests)))
            self.row_spec.append(tuple(r.spec if r.speculative else None for r in out.plan.rows))
            self.spec_k.append(out.spec_k)
            return out

        def add(req: Request) -> None:
            self.requests[req.request_id] = req
            orig_add(req)
            self.by_key[req.key] = req

        def commit(step: SchedulerOutput, tokens: list[list[CommittedToken]],
                   ended: Mapping[int, int] = NO_ENDS) -> list[Request]:
            self.zombie_rows += sum(r.sample and q.finished
                                    for r, q in zip(step.plan.rows, step.requests))
            touched = orig_commit(step, tokens, ended)
            for req in self.requests.values():
                if req.finished:
                    n = self.final_len.setdefault(req.request_id, len(req.output_token_ids))
                    assert len(req.output_token_ids) == n, "a token was appended after finish"
            return touched

        def free(key: int) -> None:
            req = self.by_key[key]
            assert req.inflight_refs == 0, "KV blocks released while a step still reads them"
            self.releases += 1
            orig_free(key)

        sched.add, sched.commit, kv.free, sched.plan = add, commit, free, plan


def run(llm: LLM, specs: list[Spec], eos: frozenset[int] | None = None) -> tuple[dict, Audit]:
    core = llm.engine
    audit = Audit(core)
    audit.install()
    if eos is not None:
        core.tokenizer.eos_token_ids = eos
    if any(s.params.structured_outputs is not None for s in specs):
        # Grammar requests wait for the grammar worker's start-up; let it finish first, so that
        # every engine sees the same admission order (and the cache pressure the specs intend).
        assert core.structured.start(wait_s=120)
    ids = [core.add_request(s.prompt, s.params, request_id=f"r{i}") for i, s in enumerate(specs)]
    aborts = {f"r{i}": s.abort_after for i, s in enumerate(specs) if s.abort_after is not None}
    results: dict[str, list[tuple[list[int], str | None]]] = {}
    while core.has_unfinished():
        for out in core.step():
            # No spec here fails: an error (an engine fault contained to its request) is a bug.
            assert out.error is None, f"{out.request_id} failed: {out.error}"
            results[out.request_id] = [(c.token_ids, c.finish_reason) for c in out.outputs]
            m = aborts.get(out.request_id)
            if m is not None and not out.finished and len(out.outputs[0].token_ids) >= m:
                core.abort(out.request_id)
    core.assert_drained()
    assert set(results) == set(ids)
    return results, audit


def _engine(pipelined: bool, **kw: object) -> LLM:
    return LLM("photon-tiny-random", **{"pipelined": pipelined, "max_model_len": 256, **kw})


def _mixed_specs() -> list[Spec]:
    rng = random.Random(3)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [
        Spec(prompt(5), greedy),
        Spec(prompt(70), SamplingParams(temperature=0.8, seed=11, max_tokens=20, ignore_eos=True)),
        Spec(prompt(9), SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=15,
                                       ignore_eos=True)),
        Spec(prompt(12), SamplingParams(temperature=0, max_tokens=1)),
        Spec(prompt(30), SamplingParams(temperature=0, max_tokens=30, stop=["e"])),
        Spec(prompt(8), SamplingParams(temperature=0.7, seed=2, max_tokens=30,
                                       stop_token_ids=[500, 501, 502, 503, 504])),
        Spec(prompt(17), greedy, abort_after=3),
        Spec(prompt(40), SamplingParams(temperature=1.0, seed=8, max_tokens=40, ignore_eos=True),
             abort_after=9),
        Spec(prompt(6), SamplingParams(temperature=0, max_tokens=40)),  # ends on the test's EOS
        Spec(prompt(25), SamplingParams(temperature=0, max_tokens=12, logprobs=2,
                                        repetition_penalty=1.3, presence_penalty=0.5)),
    ]


def test_pipelined_equals_blocking_on_mixed_workload() -> None:
    specs = _mixed_specs()
    kw = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=6, num_gpu_blocks_override=32,
              max_model_len=128)  # the cache holds one max_model_len request, not all of them
    # An EOS id the greedy request r8 produces mid-way, so that EOS ends it mid-batch.
    probe, _ = run(_engine(False, **kw), specs[8:9])
    eos = frozenset({probe["r0"][0][0][5]})
    blocking, audit_b = run(_engine(False, **kw), specs, eos)
    pipelined, audit_p = run(_engine(True, **kw), specs, eos)
    assert pipelined == blocking
    assert audit_p.schedule == audit_b.schedule
    assert blocking["r8"][0][1] == "stop" and len(blocking["r8"][0][0]) <= 6
    assert blocking["r3"][0] == (blocking["r3"][0][0], "length") and len(blocking["r3"][0][0]) == 1
    assert blocking["r6"][0][1] == "abort" and len(blocking["r6"][0][0]) == 3
    assert blocking["r7"][0][1] == "abort" and len(blocking["r7"][0][0]) == 9
    assert len({tuple(t) for t, _ in blocking["r2"]}) == 3
    assert audit_p.zombie_rows == audit_b.zombie_rows > 0  # the same schedule, zombies included
    assert audit_p.core.scheduler.num_preemptions > 0  # the small cache forced preemption


def _shared_prefix_specs() -> list[Spec]:
    """Requests on four shared prefixes, admitted a few at a time (max_num_seqs=3, a small token
    budget): each one finds as much of its prefix cached as its predecessors had published when it
    was admitted, so the hits depend on the step at which each block became visible."""
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 1000) for _ in range(n)] for n in (9, 18, 31, 44)]
    kinds = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=21, max_tokens=8, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.2, frequency_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[17, 18, 19]),
    ]
    return [Spec(prefixes[i % 4] + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 9))],
                 kinds[i % len(kinds)]) for i in range(20)]


def test_pipelined_equals_blocking_with_shared_prefixes() -> None:
    """Prefix-cache hits are identical in both loops: same schedule, same tokens."""
    specs = _shared_prefix_specs()
    kw = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=3)
    blocking, audit_b = run(_engine(False, **kw), specs)
    pipelined, audit_p = run(_engine(True, **kw), specs)
    assert audit_p.schedule == audit_b.schedule
    assert pipelined == blocking
    first_start: dict[str, int] = {}
    for rows in audit_b.schedule:
        for rid, start, _, _ in rows:
            first_start.setdefault(rid, start)
    hits = [first_start[f"r{i}" if s.params.n == 1 else f"r{i}-0"] for i, s in enumerate(specs)]
    assert sum(h > 0 for h in hits) >= 8  # most requests start from a cache hit ...
    by_prefix = [{hits[i] for i in range(k, len(specs), 4)} for k in range(4)]
    assert any(len(h) > 1 for h in by_prefix)  # ... of a length that depends on when they came


_prompt = st.lists(st.integers(3, 1023), min_size=1, max_size=48)
# Prompts on a few shared prefixes: prefix-cache hits whose length depends on admission order.
_PREFIXES = [[(7 * i + 13 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate((6, 13, 21))]
_shared_prompt = st.builds(lambda k, tail: _PREFIXES[k] + tail, st.integers(0, 2),
                           st.lists(st.integers(3, 1023), min_size=0, max_size=12))
_spec = st.builds(
    lambda prompt, max_tokens, greedy, seed, stop_id, abort: Spec(
        prompt,
        SamplingParams(temperature=0 if greedy else 1.0, seed=seed, max_tokens=max_tokens,
                       stop_token_ids=[stop_id] if stop_id else None, ignore_eos=True),
        abort),
    st.one_of(_prompt, _shared_prompt), st.integers(1, 16), st.booleans(), st.integers(0, 2**31),
    st.one_of(st.none(), st.integers(3, 1023)), st.one_of(st.none(), st.integers(1, 8)))


@settings(max_examples=18, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(_spec, min_size=1, max_size=8), block_size=st.sampled_from([4, 8]),
       budget=st.sampled_from([8, 16, 64]), tight=st.booleans())
def test_pipelined_equals_blocking_property(specs: list[Spec], block_size: int, budget: int,
                                            tight: bool) -> None:
    kw = dict(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=4,
              num_gpu_blocks_override=(64 // block_size) + 2 if tight else None,
              max_model_len=64 if tight else 256)
    blocking, audit_b = run(_engine(False, **kw), specs)
    pipelined, audit_p = run(_engine(True, **kw), specs)
    assert audit_p.schedule == audit_b.schedule
    assert pipelined == blocking


def test_abort_of_a_preempted_waiting_request_leaves_nothing_behind() -> None:
    """A request preempted (and already released) then aborted while waiting must still leave the
    scheduler's bookkeeping (regression: it stayed in `requests` forever)."""
    llm = _engine(False, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                  num_gpu_blocks_override=12, max_model_len=48)
    core = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [core.add_request([rng.randrange(3, 1000) for _ in range(8)], params) for _ in range(3)]
    victim = None
    for _ in range(200):
        core.step()
        victim = next((r for r in core.scheduler.waiting if r.req_index is None and r.num_preemptions), None)
        if victim is not None:
            break
    assert victim is not None, "the tight cache should have preempted a request"
    core.abort(victim.parent_id)
    while core.has_unfinished():
        core.step()
    core.assert_drained()
    assert victim.finish_reason is not None and victim.finish_reason.value == "abort"
    assert set(ids) >= {victim.parent_id}
