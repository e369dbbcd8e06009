"""Lockstep engine cores: the loop protocol of data-parallel cores whose MoE experts span them
(`--data-parallel-size N --enable-expert-parallel`; the group: photon.distributed.dp_experts).

Every MoE layer of a forward runs collectives over all N cores, so every core must run the same
number of forwards, in the same order. The cores' loops therefore run in rounds:

  round = agree, then (if any core has work) exactly one forward on every core.

- agree: one host all-reduce (MAX) over the group's gloo CPU group of (has_work, wake-ups seen,
  -wake-ups seen, stopping). A core has work when its engine has something to step and it is
  not paused.
- If any core has work, every core steps: a core with work runs `EngineCore.step()` (which
  launches at most one forward); a core whose step launched none (nothing to run, only commits
  left, paused) runs a dummy forward (photon.worker.dummy_step: a padding token, its K/V in the
  null block, its output dropped). Each forward starts with the agreement on its padded token
  count (`DPExperts.begin_forward`): a second small all-reduce, host only.
- If no core has work, no forward runs. When, in addition, every core has seen the same number
  of wake-ups (the round is `settled`), every core idles: it blocks on its input socket, as a
  lone core does, burning no CPU, until its next wake-up.

Wake-ups, and why an idle core never deadlocks with one that just got a request: a wake-up is
any message the front end sends to every core in equal number: each `AddRequest` goes to one core
and a `Wake` to every other core; each `Utility` call goes to every core. So all cores eventually
count the same wake-ups. Cores go idle only together (a settled round: nobody has work, all counts
equal, say W) and leave idleness only on a wake-up (count W + 1). The front end, sending a request
to core A, also sends a Wake to every other core, so each of them leaves idleness too and joins
A's next round: A's all-reduce waits (at most the collective timeout) only for messages that are
already on their way. A Wake that arrives late, after the round that served its request, cannot
start a lone round either: the late core's count was lower in the rounds since, so none of them
was settled, and the cores with the higher count went on to the next round, where the late core
joins as soon as its Wake arrives (a core whose count is below the round's maximum waits for its
inputs before the next round, instead of idling). Messages that are not wake-ups (aborts) are
applied whenever the loop reads its inputs and never start a round.

Shutdown: `Shutdown` goes to every core (CoreGroup.close sends it to all first). It counts as a
wake-up and sets `stopping`; the round that agrees on it ends every core's loop together, so cores
stopped while requests run exit cleanly too. A signal or a dead front end ends a core's loop at
once; a core that dies or hangs makes the others fail within the group's collective timeout with
`ExpertParallelError` (their loops raise it, the front end reports it).
"""

from __future__ import annotations

from collections.abc import Callable

from photon.distributed.dp_experts import DPExperts, Round
from photon.outputs import RequestOutput
from photon.worker.dummy_step import dummy_forward
from photon.worker.model_runner import ModelRunner


class Lockstep:
    """One core's side of the protocol: when to wait for inputs, the round's agreement, and
    the one forward per round."""

    def __init__(self, experts: DPExperts, runner: ModelRunner) -> None:
        self.experts = experts
        self.runner = runner
        # Wake-ups this core must have seen before its next round: W + 1 while idle after a
        # settled round at W; the round's maximum after an unsettled round without work.
        self.need = 1  # the cores start idle, having seen none

    def must_wait(self, wakeups: int) -> bool:
        """Whether to block on the inputs before the next round."""
        return wakeups < self.need

    def agree(self, has_work: bool, wakeups: int, stopping: bool) -> Round:
        """The round's agreement (and what to wait for before the next one)."""
        agreed = self.experts.agree(has_work, wakeups, stopping)
        if agreed.settled:
            self.need = agreed.max_wakeups + 1
        elif not agreed.any_work:
            self.need = agreed.max_wakeups
        else:
            self.need = 0
        return agreed

    def step(self, run: Callable[[], list[RequestOutput]]) -> list[RequestOutput]:
        """`run` (the engine's step, or nothing), then a dummy forward if it launched none:
        exactly one forward per round on every core."""
        before = self.experts.num_forwards
        outs = run()
        ran = self.experts.num_forwards - before
        if ran == 0:
            dummy_forward(self.runner)
        elif ran > 1:  # the other cores would wait for collectives that never come
            raise RuntimeError(f"lockstep broken: one engine step ran {ran} forwards")
        return outs
