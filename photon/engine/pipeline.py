"""The Photon loop: plan -> launch -> commit -> finalize.

Pipelined (depth 2), one call of `step()` is one iteration:
  1. launch(t+1)    enqueue the forward of the step planned and staged last iteration
  2. commit(t)      wait for step t's tokens (the only host sync); the grammar matchers accept
                    them and the mask fill of t+1 starts (on the fill thread); then append,
                    stop checks, finalize the finished requests
  3. plan(t+2)      scheduler builds the next batch, assuming every running request continues,
                    and the runner stages its inputs into the free slot (host only, while the
                    fill runs)
  4. finalize(t+1)  sample t+1 with the state committed at t (its masks, once filled); enqueue
                    the D2H copy
The GPU runs forward t+1 while the host commits t and plans t+2. Planning t+2 before finalizing
t+1 changes nothing it reads: finalize touches only the runner's device work.
Blocking (depth 1): plan, launch, finalize and commit each step in turn: the A/B baseline and the
test oracle.
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
        committed = bool(self.inflight)
        if committed:
            touched += self._commit(self.inflight.popleft(), handle)
        if handle is not None:
            self.staged = self._plan()
            self.runner.finalize(handle)
            self.inflight.append(handle)
        elif not committed and self.scheduler.has_unfinished():
            raise RuntimeError("engine made no progress: nothing schedulable and nothing in flight")
        return touched

    def _step_blocking(self) -> list[Request]:
        assert self.staged is None, "switch the depth only while the pipeline is idle"
        prep = self._plan()
        if prep is None:
            if self.scheduler.has_unfinished():
                raise RuntimeError("engine made no progress: nothing schedulable")
            return []
        handle = self.runner.launch(prep)
        self.runner.finalize(handle)
        return self._commit(handle)

    def _plan(self) -> PreparedStep | None:
        plan = self.scheduler.plan()
        return self.runner.prepare(plan) if not plan.empty else None

    def _commit(self, handle: StepHandle, following: StepHandle | None = None) -> list[Request]:
        """Commit `handle`; the grammar masks of `following` (launched, not yet finalized) start
        filling as soon as the matchers hold this step's tokens."""
        tokens = self.runner.wait(handle)
        if handle.arrays.flags["any_grammar"]:
            self.scheduler.advance_grammars(handle.rows, tokens)
        if following is not None:
            self.runner.begin_masks(following)
        return self.scheduler.commit(handle.rows, tokens)

    @property
    def idle(self) -> bool:
        return not self.inflight and self.staged is None
