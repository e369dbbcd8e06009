"""A model-free `StepRunner` and a harness that drives the real scheduler and pipeline with it.

The fake runner keeps its own request table from the plans (`new_requests` enter it, `released`
leave it) and checks the step contract as it goes: indices enter free and leave held, rows name
held indices, a row's inputs are known when it launches, a released index is read by no launched
step, non-empty plans are numbered 0, 1, 2, ... Its tokens are a function of the request's RNG key
and the output index (what a seeded sampler depends on), so a preempted and recomputed request
draws the same tokens; `script` overrides them per (key, output index) to inject EOS or stop ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from photon.config import SchedulerConfig
from photon.core.sampling import IntCol, derive_key, pack_sampling
from photon.core.step import CommittedToken, PromptScores, StepPlan
from photon.engine.kv_cache import KVCacheManager
from photon.engine.pipeline import Pipeline
from photon.engine.request import Request
from photon.engine.scheduler import Scheduler, SchedulerOutput
from photon.sampling_params import SamplingParams
from photon.structured.step import GrammarStep

EOS = 2
VOCAB = 1000
Event = tuple[Any, ...]
RowTuple = tuple[int, int, int, bool, int, tuple[int, ...]]
PlanTuple = tuple[int, tuple[RowTuple, ...], tuple[tuple[int, tuple[int, ...]], ...],
                  tuple[int, ...], int]


def default_token(key: int, out_index: int) -> int:
    """Never EOS: tokens in [100, VOCAB)."""
    return 100 + (key * 7 + out_index * 13) % (VOCAB - 100)


def plan_tuple(plan: StepPlan) -> PlanTuple:
    """A plan as plain values (block lists copied: the plan holds the KV manager's live lists)."""
    rows = tuple((r.req_index, r.start, r.num_tokens, r.sample, r.out_index, tuple(r.block_ids))
                 for r in plan.rows)
    new = tuple((n.req_index, tuple(n.token_ids)) for n in plan.new_requests)
    return plan.step, rows, new, tuple(plan.released), plan.num_tokens


@dataclass
class Entry:
    """The runner's state of one request index: its key and every token it knows (the
    committed ones it was given, then those its launched steps sampled)."""

    key: int
    prompt_len: int
    tokens: list[int]


@dataclass
class Handle:
    plan: StepPlan
    sampled: list[int] = field(default_factory=list)  # sampling order
    done: bool = False


class FakeRunner:
    def __init__(self, log: list[Event], script: dict[tuple[int, int], int] | None = None,
                 block_size: int = 4) -> None:
        self.log = log  # shared with the harness, which adds commits and calls
        self.script = script or {}
        self.block_size = block_size
        self.table: dict[int, Entry] = {}
        self.plans: list[PlanTuple] = []  # every plan prepared, empty ones included
        self.raw_plans: list[StepPlan] = []
        self.next_step = 0
        self.launched: list[Handle] = []  # launched, not yet waited

    def token(self, key: int, out_index: int) -> int:
        return self.script.get((key, out_index), default_token(key, out_index))

    def prepare(self, plan: StepPlan) -> Handle | None:
        self.raw_plans.append(plan)
        self.plans.append(plan_tuple(plan))
        self.log.append(("empty", tuple(plan.released)) if plan.empty else ("plan", plan.step))
        self._apply_table(plan)
        if plan.empty:
            return None
        assert plan.step == self.next_step, f"plan {plan.step} after {self.next_step - 1}"
        self.next_step += 1
        assert plan.num_tokens == sum(r.num_tokens for r in plan.rows)
        for row in plan.rows:
            assert row.req_index in self.table, f"row of index {row.req_index} not in the table"
            assert len(row.block_ids) * self.block_size >= row.seq_len, "row past its blocks"
        return Handle(plan)

    def _apply_table(self, plan: StepPlan) -> None:
        for i in plan.released:
            assert i in self.table, f"released index {i} is not held"
            assert all(i not in {r.req_index for r in h.plan.rows} for h in self.launched), \
                f"index {i} released while a launched step reads it"
            del self.table[i]
        for new in plan.new_requests:
            assert new.req_index not in self.table, f"index {new.req_index} is already held"
            key, plen = new.sampling.ints[IntCol.KEY], new.sampling.ints[IntCol.PROMPT_LEN]
            outputs = new.token_ids[plen:]  # a readmitted request's committed outputs
            assert outputs == [self.token(key, j) for j in range(len(outputs))]
            self.table[new.req_index] = Entry(key, plen, list(new.token_ids))

    def launch(self, prepared: Handle) -> Handle:
        self.log.append(("launch", prepared.plan.step))
        for row in prepared.plan.rows:  # every input token was committed or sampled before
            entry = self.table[row.req_index]
            assert row.seq_len <= len(entry.tokens), "a row reads a token nobody sampled"
            if row.sample:
                assert row.out_index == row.seq_len - entry.prompt_len
        self.launched.append(prepared)
        return prepared

    def sample(self, handle: Handle) -> None:
        self.log.append(("sample", handle.plan.step))
        for row in handle.plan.rows:
            if row.sample:
                entry = self.table[row.req_index]
                assert len(entry.tokens) == row.seq_len, "a sampled token would be overwritten"
                tok = self.token(entry.key, row.out_index)
                entry.tokens.append(tok)
                handle.sampled.append(tok)

    def sync(self, handle: Handle) -> None:
        self.log.append(("sync", handle.plan.step))

    def wait(self, handle: Handle) -> list[list[CommittedToken]]:
        self.log.append(("wait", handle.plan.step))
        assert not handle.done and self.launched[0] is handle, "steps are waited in order"
        self.launched.pop(0)
        handle.done = True
        sampled = iter(handle.sampled)
        return [[CommittedToken(next(sampled))] if r.sample else [] for r in handle.plan.rows]

    def sampled_ids(self, handle: Handle) -> np.ndarray:
        return np.array(handle.sampled, dtype=np.int64)

    def prompt_scores(self, handle: Handle) -> list[PromptScores]:
        return []


def make_request(request_id: str, prompt: list[int], max_tokens: int, seed: int,
                 **params: Any) -> Request:
    """A request as EngineCore.add_request builds it (no detokenizer, no grammar)."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, seed=seed, **params)
    eos = frozenset({EOS})
    sampling = pack_sampling(sp, derive_key(seed), len(prompt), max_tokens, VOCAB, eos)
    return Request(request_id, list(prompt), sp, eos, max_tokens, sampling)


def key_of(req: Request) -> int:
    return req.sampling.ints[IntCol.KEY]


class Harness:
    """The real scheduler, KV manager and pipeline around a FakeRunner; records commits, KV
    frees and preemptions into the runner's event log and counts zombie rows at commit."""

    def __init__(self, depth: int, max_num_seqs: int = 4, budget: int = 64,
                 num_blocks: int = 64, block_size: int = 4, prefix_caching: bool = True,
                 script: dict[tuple[int, int], int] | None = None,
                 kv_events: bool = False) -> None:
        self.log: list[Event] = []
        self.kv = KVCacheManager(num_blocks, block_size, prefix_caching,
                                 enable_kv_cache_events=kv_events)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget), self.kv)
        self.runner = FakeRunner(self.log, script, block_size)
        grammar = GrammarStep(SimpleNamespace(in_flight=False), max_num_seqs)  # no grammar row
        self.pipeline = Pipeline(self.sched, self.runner, grammar, depth)
        self.requests: dict[str, Request] = {}
        self.by_key: dict[int, Request] = {}  # the scheduler's key of each request
        self.zombie_rows: dict[str, int] = {}
        self.num_calls = 0
        self._wrap()

    def _wrap(self) -> None:
        sched, kv, log = self.sched, self.kv, self.log
        commit, free, preempt = sched.commit, kv.free, sched.preempt

        def logged_commit(step: SchedulerOutput, tokens: list[list[CommittedToken]],
                          ended: frozenset[int] = frozenset()) -> list[Request]:
            for row, req in zip(step.plan.rows, step.requests):
                if row.sample and req.finished:
                    self.zombie_rows[req.request_id] = self.zombie_rows.get(req.request_id, 0) + 1
            touched = commit(step, tokens, ended)
            log.append(("commit", step.plan.step))
            return touched

        def logged_free(key: int) -> None:
            req = self.by_key[key]
            assert req.inflight_refs == 0, f"{req.request_id} freed with a step in flight"
            log.append(("free", req.request_id))
            free(key)

        def logged_preempt(req: Request) -> None:
            running = [r.request_id for r in sched.running]
            log.append(("preempt", req.request_id, tuple(running), req.inflight_refs))
            preempt(req)

        sched.commit, kv.free, sched.preempt = logged_commit, logged_free, logged_preempt

    def add(self, req: Request) -> Request:
        self.requests[req.request_id] = req
        self.sched.add(req)
        self.by_key[req.key] = req
        return req

    @property
    def busy(self) -> bool:
        sched = self.sched
        return sched.has_unfinished() or not self.pipeline.idle or sched.has_releases

    def step(self) -> None:
        self.num_calls += 1
        self.log.append(("call", self.num_calls))
        self.pipeline.step()

    def drain(self, max_calls: int = 200) -> None:
        for _ in range(max_calls):
            if not self.busy:
                break
            self.step()
        assert not self.busy, f"not drained after {max_calls} calls"

    def assert_drained(self) -> None:
        assert self.runner.table == {}, f"runner still holds {sorted(self.runner.table)}"
        assert not self.runner.launched
        assert self.kv.num_used_blocks == 0
        assert len(self.sched.free_indices) == len(self.sched.by_index)
        assert self.sched.num_unreleased == 0
        self.kv.check_invariants()

    def run(self, arrivals: dict[int, list[Request]], aborts: dict[int, list[str]],
            max_calls: int = 200) -> None:
        """Before call k (from 0): add arrivals[k], abort aborts[k]; then drain."""
        last = max([*arrivals, *aborts], default=0)
        for k in range(max_calls):
            for req in arrivals.get(k, []):
                self.add(req)
            for rid in aborts.get(k, []):
                self.sched.abort(self.requests[rid])
            if k > last and not self.busy:
                break
            self.step()
        assert not self.busy, f"not drained after {max_calls} calls"

    def calls(self) -> list[list[Event]]:
        """The event log split per step() call (the markers dropped)."""
        out: list[list[Event]] = []
        for ev in self.log:
            if ev[0] == "call":
                out.append([])
            elif out:
                out[-1].append(ev)
        return out


@dataclass
class Workload:
    arrivals: dict[int, list[Request]]
    aborts: dict[int, list[str]]
    script: dict[tuple[int, int], int]

    def harness(self, depth: int) -> Harness:
        return Harness(depth, budget=8, num_blocks=11, script=self.script)


def mixed_workload() -> Workload:
    """Prompts of 2 to 12 tokens (chunked at a budget of 8), an EOS stop, a stop id, an abort
    of a running request and, with 10 usable KV blocks of 4 tokens, preemptions."""
    reqs = {rid: make_request(rid, list(range(10 + i, 10 + i + plen)), max_tokens, seed=i + 1,
                              **kw)
            for i, (rid, plen, max_tokens, kw) in enumerate([
                ("a", 10, 12, {}), ("b", 3, 10, {}), ("c", 7, 9, {}), ("d", 5, 20, {}),
                ("e", 12, 6, {}), ("f", 2, 8, {"stop_token_ids": [7]})])}
    script = {(key_of(reqs["b"]), 4): EOS, (key_of(reqs["f"]), 3): 7}
    arrivals = {0: [reqs["a"], reqs["b"]], 2: [reqs["c"], reqs["d"]], 4: [reqs["e"]],
                5: [reqs["f"]]}
    return Workload(arrivals, {10: ["d"]}, script)
