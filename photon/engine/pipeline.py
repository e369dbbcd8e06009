"""The Photon loop: plan -> launch -> commit -> sample.

Pipelined (depth 2), one call of `step()` is one iteration:
  1. launch(t+1)    enqueue the forward of the step planned and staged last iteration
  2. commit(t)      collect the last grammar job; wait for step t's tokens (the only host sync);
                    begin this step's grammar job (the matchers accept token t, then fill the
                    masks of t+1: in the grammar worker); append, stop checks, finish the
                    requests that stopped
  3. plan(t+2)      the scheduler builds the next batch, assuming every running request
                    continues, and the runner stages its inputs into the free slot (host only)
  4. sample(t+1)    sample t+1 with the state committed at t, its masks fenced on the grammar job
                    (on CUDA the GPU waits for the worker's fence word; otherwise the host waits
                    for the job here); enqueue the D2H copy
The GPU runs forward t+1 while the host commits t and plans t+2, and the grammar job runs beside
both. Planning t+2 before sampling t+1 changes nothing plan reads: sample only enqueues device
work. A grammar that rejected its token (an engine bug) aborts its request when the job is
collected: by the next commit, before that commit's tokens count.

Blocking (depth 1), the A/B baseline and the test oracle: one call is commit(t), launch(t+1),
sample(t+1), the host waits for t+1's tokens, plan(t+2). The GPU idles while the host commits
and plans, but the scheduler sees exactly what it sees pipelined: plan(t+2) runs after commit(t)
and before commit(t+1) in both loops, and each call returns the outputs of the same commit. So
both loops plan the same batches (zombie rows included), admit each request at the same step and
find the same prefix-cache hits: a block published at commit(t) is hittable from plan(t+2) in
both. Equal schedules make equal tokens even where a cache hit and a recompute differ in the last
bit (bf16 near-ties).

The pipeline drives any `photon.core.runner.StepRunner` (tests use a fake one) and the grammar
step; it pairs each runner handle with the scheduler's view of the step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from photon.core.runner import StepRunner
from photon.engine.request import Request
from photon.engine.scheduler import Scheduler, SchedulerOutput
from photon.structured.step import GrammarStep


@dataclass(frozen=True, slots=True)
class _Step:
    """A step on its way through the loop: the scheduler's view and the runner's object (the
    prepared inputs while staged, the handle once launched)."""

    planned: SchedulerOutput
    runner: Any


class Pipeline:
    def __init__(self, scheduler: Scheduler, runner: StepRunner, grammar: GrammarStep,
                 depth: int) -> None:
        if depth not in (1, 2):
            raise ValueError(f"pipeline depth must be 1 or 2, got {depth}")
        self.scheduler = scheduler
        self.runner = runner
        self.grammar = grammar
        self.depth = depth
        self.inflight: deque[_Step] = deque()  # sampled, not yet committed
        self.staged: _Step | None = None  # planned and staged, not yet launched

    def step(self) -> list[Request]:
        """Run one iteration; return the requests that received tokens or were finished."""
        if self.depth == 1:
            return self._step_blocking()
        if self.staged is None:
            self.staged = self._plan()
        launched = self._launch(self.staged) if self.staged is not None else None
        self.staged = None
        touched: list[Request] = []
        committing = self.inflight.popleft() if self.inflight else None
        if committing is not None:
            touched += self._commit(committing, launched)
        if launched is not None:
            self.staged = self._plan()
            self.runner.sample(launched.runner)
            self.inflight.append(launched)
        else:
            touched += self._end_grammar_step()  # nothing samples next: collect the job now
            self._end_idle(committing)
        return touched

    def _launch(self, staged: _Step) -> _Step:
        return _Step(staged.planned, self.runner.launch(staged.runner))

    def _commit(self, committing: _Step, launched: _Step | None) -> list[Request]:
        """commit(t): the grammar job of the last iteration ends first (its fills were for
        step t, whose tokens are awaited next, so this costs no wait); then step t's tokens,
        the job of this iteration (their accepts, the fills of `launched`), the bookkeeping."""
        touched = self._end_grammar_step()
        handle, number = committing.runner, committing.planned.plan.step
        tokens = self.runner.wait(handle)
        ended = self.grammar.begin(number, self.runner.sampled_ids(handle),
                                   launched.planned.plan.step if launched is not None else None)
        self.scheduler.add_prompt_logprobs(self.runner.prompt_scores(handle))
        return touched + self.scheduler.commit(committing.planned, tokens, ended)

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
            self._end_idle(committing)
            return touched
        launched = self._launch(self.staged)
        self.runner.sample(launched.runner)
        self.runner.sync(launched.runner)  # the blocking wait: nothing is enqueued meanwhile
        self.staged = self._plan()
        self.inflight.append(launched)
        return touched

    def _end_idle(self, committed: _Step | None) -> None:
        """Nothing is staged: hand the runner the releases of this call's commit now (no later
        plan may come), and fail loudly if requests wait that can never be planned."""
        sched = self.scheduler
        if sched.has_releases:
            self._prepare(sched.releases_only())
        if committed is None and sched.has_unfinished() and not sched.waits_elsewhere:
            raise RuntimeError("engine made no progress: nothing schedulable and nothing in flight")

    def _plan(self) -> _Step | None:
        """plan, and the runner stages the plan (an empty one still carries its releases)."""
        return self._prepare(self.scheduler.plan())

    def _prepare(self, planned: SchedulerOutput) -> _Step | None:
        self.grammar.plan(planned)
        prepared = self.runner.prepare(planned.plan)
        return _Step(planned, prepared) if prepared is not None else None

    def _end_grammar_step(self) -> list[Request]:
        """Collect the grammar job in flight; abort the requests whose token it rejected, or
        every grammar request if the grammar executor failed (the engine serves on)."""
        outcome = self.grammar.end()
        if outcome.lost is not None:
            return self.scheduler.fail_grammars(
                f"structured outputs are unavailable: {outcome.lost}")
        self.scheduler.reject_grammars(outcome.rejected)
        return outcome.rejected

    @property
    def idle(self) -> bool:
        return not self.inflight and self.staged is None
