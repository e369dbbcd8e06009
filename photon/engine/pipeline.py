"""The Photon loop: plan -> launch -> commit -> finalize.

One call of `step()` is one iteration:
  1. plan(t+1)      scheduler builds the batch, assuming every running request continues
  2. launch(t+1)    runner stages inputs into the free slot and enqueues the forward
  3. commit(t)      wait for step t's tokens (the only host sync); grammar matchers accept them (one
                    backend call); append, stop checks, finalize the finished requests
  4. finalize(t+1)  sample t+1 with the state committed at t; enqueue the D2H copy
At depth 2 (pipelined) the GPU runs forward t+1 while the host commits t. At depth 1 (blocking) the
same code commits each step right after finalizing it: the A/B baseline and the test oracle.
"""

from __future__ import annotations

from collections import deque

from photon.engine.request import Request
from photon.engine.scheduler import Scheduler
from photon.worker.model_runner import ModelRunner, StepHandle


class Pipeline:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, depth: int) -> None:
        if depth not in (1, 2):
            raise ValueError(f"pipeline depth must be 1 or 2, got {depth}")
        self.scheduler = scheduler
        self.runner = runner
        self.depth = depth
        self.inflight: deque[StepHandle] = deque()

    def step(self) -> list[Request]:
        """Run one iteration; return the requests that received tokens or were finalized."""
        plan = self.scheduler.plan()
        handle = self.runner.launch(plan) if not plan.empty else None
        touched: list[Request] = []
        committed = bool(self.inflight)
        if committed:
            touched += self._commit(self.inflight.popleft())
        if handle is not None:
            self.runner.finalize(handle)
            self.inflight.append(handle)
            if self.depth == 1:
                touched += self._commit(self.inflight.popleft())
        elif not committed and self.scheduler.has_unfinished():
            raise RuntimeError("engine made no progress: nothing schedulable and nothing in flight")
        return touched

    def _commit(self, handle: StepHandle) -> list[Request]:
        tokens = self.runner.wait(handle)
        if handle.arrays.flags["any_grammar"]:
            self.scheduler.advance_grammars(handle.rows, tokens)
        return self.scheduler.commit(handle.rows, tokens)

    @property
    def idle(self) -> bool:
        return not self.inflight
