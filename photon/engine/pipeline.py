"""The Photon loop: plan -> launch -> commit -> finalize.

Pipelined (depth 2), one call of `step()` is one iteration:
  1. launch(t+1)    enqueue the forward of the step planned and staged last iteration
  2. commit(t)      collect the last grammar job; wait for step t's tokens (the only host sync);
                    submit this step's grammar job (the matchers accept token t, then fill the
                    masks of t+1: in the grammar worker); append, stop checks, finalize the
                    finished requests
  3. plan(t+2)      the scheduler builds the next batch, assuming every running request
                    continues, and the runner stages its inputs into the free slot (host only)
  4. finalize(t+1)  sample t+1 with the state committed at t, its masks fenced on the grammar job
                    (on CUDA the GPU waits for the worker's fence word; otherwise the host waits
                    for the job here); enqueue the D2H copy
The GPU runs forward t+1 while the host commits t and plans t+2, and the grammar job runs beside
both. Planning t+2 before finalizing t+1 changes nothing plan reads: finalize only enqueues device
work. A grammar that rejected its token (an engine bug) aborts its request when the job is
collected: by the next commit, before that commit's tokens count.

Blocking (depth 1), the A/B baseline and the test oracle: one call is commit(t), launch(t+1),
finalize(t+1), the host waits for t+1's tokens, plan(t+2). The GPU idles while the host commits
and plans, but the scheduler sees exactly what it sees pipelined: plan(t+2) runs after commit(t)
and before commit(t+1) in both loops, and each call returns the outputs of the same commit. So
both loops plan the same batches (zombie rows included), admit each request at the same step and
find the same prefix-cache hits: a block published at commit(t) is hittable from plan(t+2) in
both. Equal schedules make equal tokens even where a cache hit and a recompute differ in the last
bit (bf16 near-ties).
"""

from __future__ import annotations

from collections import deque

from photon.engine.request import Request
from photon.engine.scheduler import Scheduler
from photon.worker.model_runner import ModelRunner, PreparedStep, StepHandle


class Pipeline:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, depth: int) -> None:
        if depth not in (1, 2):
            raise ValueError(f"pipeline depth must be 1 or 2, got {depth}")
        self.scheduler = scheduler
        self.runner = runner
        self.depth = depth
        self.inflight: deque[StepHandle] = deque()  # finalized, not yet committed
        self.staged: PreparedStep | None = None  # planned and staged, not yet launched

    def step(self) -> list[Request]:
        """Run one iteration; return the requests that received tokens or were finalized."""
        if self.depth == 1:
            return self._step_blocking()
        if self.staged is None:
            self.staged = self._plan()
        handle = self.runner.launch(self.staged) if self.staged is not None else None
        self.staged = None
        touched: list[Request] = []
        committing = self.inflight.popleft() if self.inflight else None
        if committing is not None:
            touched += self._commit(committing, handle)
        if handle is not None:
            self.staged = self._plan()
            self.runner.finalize(handle)
            self.inflight.append(handle)
        else:
            touched += self._end_grammar_step()  # nothing samples next: collect the job now
            if committing is None and self.scheduler.has_unfinished():
                raise RuntimeError("engine made no progress: nothing schedulable and nothing "
                                   "in flight")
        return touched

    def _commit(self, committing: StepHandle, handle: StepHandle | None) -> list[Request]:
        """commit(t): the grammar job of the last iteration ends first (its fills were for
        step t, whose tokens are awaited next, so this costs no wait); then step t's tokens,
        the job of this iteration (their accepts, the fills of `handle`), the bookkeeping."""
        touched = self._end_grammar_step()
        tokens = self.runner.wait(committing)
        self.runner.begin_grammar_step(committing, handle)
        self.scheduler.add_prompt_logprobs(self.runner.prompt_scores(committing))
        return touched + self.scheduler.commit(committing.rows, tokens)

    def _step_blocking(self) -> list[Request]:
        """The pipelined call's order of plan and commit, without the overlap (module docstring)."""
        if self.staged is None:
            self.staged = self._plan()
        touched: list[Request] = []
        committing = self.inflight.popleft() if self.inflight else None
        if committing is not None:
            touched += self._commit(committing, None)
        touched += self._end_grammar_step()
        if self.staged is None:
            if committing is None and self.scheduler.has_unfinished():
                raise RuntimeError("engine made no progress: nothing schedulable and nothing "
                                   "in flight")
            return touched
        handle = self.runner.launch(self.staged)
        self.runner.finalize(handle)
        self.runner.sync(handle)  # the blocking wait: nothing is enqueued while the host works
        self.staged = self._plan()
        self.inflight.append(handle)
        return touched

    def _plan(self) -> PreparedStep | None:
        plan = self.scheduler.plan()
        return self.runner.prepare(plan) if not plan.empty else None

    def _end_grammar_step(self) -> list[Request]:
        """Collect the grammar job in flight; abort the requests whose token it rejected, or
        every grammar request if the grammar executor failed (the engine serves on)."""
        grammars, lost = self.runner.end_grammar_step()
        if lost is not None:
            return self.scheduler.fail_grammars(f"structured outputs are unavailable: {lost}")
        if not grammars:
            return []
        rejected = set(map(id, grammars))
        requests = [r for r in self.scheduler.requests.values() if id(r.grammar) in rejected]
        self.scheduler.reject_grammars(requests)
        return requests

    @property
    def idle(self) -> bool:
        return not self.inflight and self.staged is None
