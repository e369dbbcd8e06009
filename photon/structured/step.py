"""GrammarStep: the one owner of a step's grammar work on the engine side.

It keeps the grammar rows (photon.structured.rows, by request index), each planned step's
grammar rows and masks, the job in flight and what it found. The pipeline calls `plan` for every
plan, `begin` right after commit(t)'s wait (the matchers accept step t's tokens, then fill the
masks of step t+1) and `end` to collect the job; the model runner calls `masks_for` while it
samples a step. Steps without a grammar row cost a dictionary lookup.

Buffers: the masks of step s are written into the executor's host buffer s % 2 (the runner's slot
index): the step that used it before, s - 2, was committed (its sampling done) before the job that
fills it was submitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from photon.core.runner import StepMasks
from photon.structured.bitmask import TokenMask, mask_numel
from photon.structured.executor import StepJob
from photon.structured.rows import Drafter, GrammarRows, RowLayout, StepFills

if TYPE_CHECKING:
    from photon.engine.request import Request
    from photon.engine.scheduler import SchedulerOutput
    from photon.structured.manager import StructuredOutputManager

_NONE = np.zeros(0, dtype=np.int64)
NO_ENDS: dict[int, int] = {}  # never written: `begin` returns a new dict when a grammar ends


@dataclass
class _PlannedGrammar:
    """A planned step's sampling rows, when one of them has a grammar."""

    requests: list[Request]  # sampling order
    req: np.ndarray  # their request indices
    counters: np.ndarray  # their output indices (-1: a speculative row's, the device's)
    layout: RowLayout | None  # their mask rows when a row verifies drafts (None: one each)
    mask: TokenMask | None = None  # host views, once its fill was submitted
    fills: StepFills | None = None  # which rows its job fills (they accept at its commit)


@dataclass(frozen=True)
class GrammarOutcome:
    """What the jobs collected by `end` found."""

    rejected: list[Request]  # whose matcher refused its committed token
    lost: str | None  # why the grammar executor failed (every grammar request must end)


class GrammarStep:
    def __init__(self, manager: StructuredOutputManager, num_rows: int,
                 drafter: Drafter | None = None) -> None:
        """`drafter`: the host's n-gram proposal when grammar rows speculate (ngram method)."""
        self.manager = manager
        self.num_rows = num_rows
        self.drafter = drafter
        self._rows: GrammarRows | None = None  # with the first grammar request
        self._assigned: set[int] = set()  # request indices holding a grammar row
        self._planned: dict[int, _PlannedGrammar] = {}  # by step number, until committed
        self._accepting: list[Request] = []  # the requests of the job in flight's accepts
        self._rejected: list[Request] = []  # collected, not yet handed on
        self._lost: str | None = None  # why the executor failed, not yet handed on
        self.wait_s = 0.0  # engine-thread time waiting for grammar jobs (bench structured)

    @property
    def rows(self) -> GrammarRows:
        if self._rows is None:
            backend = self.manager.backend
            self._rows = GrammarRows(self.num_rows, backend.stop_token_ids, backend.mask_words,
                                     self.drafter)
        return self._rows

    # ---- plan ---------------------------------------------------------------------------------
    def plan(self, out: SchedulerOutput) -> None:
        """Track the plan's table changes; remember its sampling rows if one has a grammar."""
        for i in out.plan.released:
            if i in self._assigned:
                self._assigned.discard(i)
                self.rows.release(i)
        for new, req in zip(out.plan.new_requests, out.admitted):
            if req.grammar is not None:
                self.rows.assign(new.req_index, req)
                self._assigned.add(new.req_index)
        if not self._assigned or out.plan.empty:
            return
        rows = out.plan.rows
        sample = [j for j, r in enumerate(rows) if r.sample]
        req = np.fromiter((rows[j].req_index for j in sample), dtype=np.int64, count=len(sample))
        if (self.rows.handle[req] >= 0).any():
            counters = np.fromiter((-1 if rows[j].speculative else rows[j].out_index
                                    for j in sample), dtype=np.int64, count=len(sample))
            widths = np.fromiter((rows[j].spec + 1 for j in sample), dtype=np.int64,
                                 count=len(sample))
            self._planned[out.plan.step] = _PlannedGrammar(
                [out.requests[j] for j in sample], req, counters, RowLayout.of(widths))

    # ---- the job ------------------------------------------------------------------------------
    def begin(self, committed: int | None, sampled: np.ndarray | None,
              upcoming: int | None) -> dict[int, int]:
        """Submit one job: the matchers accept the tokens `sampled` of step `committed` (its wait
        done; every sampling row's, K_eff + 1 per speculative row), then fill the masks of step
        `upcoming`. Returns, by request index, the grammars those tokens end: at which of the
        row's committed tokens."""
        acc = self._planned.pop(committed, None) if committed is not None else None
        nxt = self._planned.get(upcoming) if upcoming is not None else None
        if (acc is None or acc.fills is None) and nxt is None:
            return NO_ENDS
        assert not self.manager.in_flight, "a grammar job was submitted before the last one ended"
        job = StepJob(_NONE, _NONE, _NONE, _NONE)
        ended = NO_ENDS
        if acc is not None and acc.fills is not None:
            accepts = self.rows.accept(acc.fills, acc.requests, sampled)
            job.acc_handles, job.acc_tokens = accepts.handles, accepts.tokens
            self._accepting = [acc.requests[j] for j in accepts.rows.tolist()]
            if accepts.ended.size:
                ended = dict(zip(acc.req[accepts.ended].tolist(), accepts.ended_at.tolist()))
        if nxt is not None:
            self._fill(nxt, upcoming, job)
        if not job.empty and self._lost is None:
            try:
                self.manager.submit(job, nxt.mask if nxt is not None else None,
                                    upcoming % 2 if upcoming is not None else 0)
            except RuntimeError as e:  # masks_for makes the masks allow-all
                self._lost = str(e)
        return ended

    def _fill(self, step: _PlannedGrammar, number: int, job: StepJob) -> None:
        rows = self.rows
        n = len(step.requests) if step.layout is None else step.layout.total
        host = self.manager.executor.mask_buffer(number % 2, mask_numel(n, rows.views.words))
        step.mask = rows.views(host, n)
        fills = step.fills = rows.fill(step.requests, step.req, step.counters, step.mask,
                                       step.layout)
        job.fill_rows = fills.rows if fills.mask_rows is None else fills.mask_rows
        job.fill_handles = fills.handles
        job.fill_drafts, job.draft_tokens = fills.num_drafts, fills.draft_tokens

    def masks_for(self, step: int, device_wait: bool) -> StepMasks | None:
        """The masks of `step` (None without a grammar row), filled now if no job did (the
        blocking loop, the first step); with `device_wait`, fenced on the job instead of
        waiting for it."""
        planned = self._planned.get(step)
        if planned is None:
            return None
        if planned.mask is None:
            self.begin(None, None, step)
        fence = None
        if self.manager.in_flight and device_wait:
            fence = self.manager.executor.device_fence(step % 2)
        if fence is None:
            self._collect()
        if self._lost is not None:  # no matcher filled them, or only part: unconstrained
            planned.mask.flat.fill_(-1)  # (every grammar request fails at the next end())
        return StepMasks(planned.mask, fence)

    def end(self) -> GrammarOutcome:
        """Wait for the submitted job if the sampling did not; what the jobs collected since the
        last call found."""
        self._collect()
        outcome = GrammarOutcome(self._rejected, self._lost)
        self._rejected, self._lost = [], None
        return outcome

    def _collect(self) -> None:
        if not self.manager.in_flight:
            return
        start = time.perf_counter()
        try:
            rejected = self.manager.wait()
            self._rejected += [self._accepting[i] for i in rejected]
        except RuntimeError as e:  # the worker died or the job failed: the engine goes on
            self._lost = str(e)
        self._accepting = []
        self.wait_s += time.perf_counter() - start
