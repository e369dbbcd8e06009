"""The adaptive switch: how many drafts a step verifies, chosen per step on the host.

Each step the scheduler asks `AdaptiveSpec.choose(B)` for K_eff in 0..K, the drafts every
speculative row of the step verifies (B: the requests the step may run). It maximises tokens per
second,

    E'(k) / T(B, k),   E'(k) = 1 + p * sum_{j < k} a_j,

where a_j is the share of draft runs whose draft j was accepted (the engine's running
per-position counts, `SpecDecodingStats`; prior pseudo-counts before any exist), p the share of
the rows of steps verifying drafts that had drafts to verify (an ngram row without a match, a
row right after the switch turned on, emits one token) and T(B, k) the step time a
`StepCostModel` predicts for B rows verifying k drafts. K_eff = 0 is the plain decode step: the
scheduler plans plain rows for the requests whose length the host knows. It speculates
(K_eff > 0) only when the best rate beats the plain step's, 1 / T(B, 0), by more than
`SWITCH_MARGIN`: a speculating batch has costs its decode-step times leave out (requests finish
on different steps, so refills land in mixed steps beside speculative rows; the first step after
a switch verifies nothing), so a K_eff the model rates about even with 0 loses. Where those
costs outweigh a wider predicted gain, the engine's `RealizedGuard` (photon.spec.guard), which
compares whole windows of committed steps with and without speculation, vetoes it.

`MeasuredCostModel`, the default, keeps an online estimate of T per (batch-size bucket, k): the
median of the last `window` times between consecutive committed decode steps of the same K_eff.
The median, because a small model's steps are host-bound and a garbage-collection pause or a
neighbour process makes single steps several times longer: with a running mean one such step
can make K_eff = 0 look slower than speculating, and while the switch speculates K_eff = 0 is
not measured again to correct it. A step right after a change of K_eff is not measured: the
first step after switching on verifies nothing (its drafts were not proposed yet) and the draft
model catches up on the positions it skipped. It predicts unmeasured entries with a
roofline-style prior: a step streams the weights once (a fixed cost) until its query tokens
B * (k + 1) saturate the compute units, then grows with them. The prior is scaled by a
measured plain step, the bucket's or else the nearest bucket's, and the switch times one
(K_eff = 0 on the engine's first decode steps) before it speculates: scaled from a speculative
step instead, the prior would price the plain step of a host-bound engine (whose speculative
steps cost more than the prior's ratio says) too high, and the switch, speculating, would not
time it. (The nearest bucket's, because the rows of a step may stay below the batch the switch
is asked about, when the KV cache holds fewer requests than may run: that bucket's steps are
never timed.)
Everything is host data: the decision never synchronises with the device.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from photon.spec.guard import RealizedGuard, nearest_bucket
from photon.spec.stats import SpecDecodingStats

PRIOR_RUNS = 8  # pseudo draft runs of the acceptance prior
PRIOR_ACCEPT = 0.6  # prior acceptance of each draft given the previous ones
SWITCH_MARGIN = 0.1  # K_eff > 0 must beat the plain step's predicted rate by this fraction
IDLE_CAP = 16  # a step counts at most this many predicted plain steps' time in the guard


class StepCostModel(Protocol):
    """Predicted seconds of a decode step of `batch_size` rows verifying `k` drafts each."""

    def step_time(self, batch_size: int, k: int) -> float: ...

    def knows_plain_step(self) -> bool: ...

    def observe(self, batch_size: int, k: int, seconds: float) -> None: ...


class SpecPolicy(Protocol):
    """The scheduler's hook: K_eff per step, and each committed step's shape."""

    def choose(self, batch_size: int) -> int: ...

    def committed(self, step: int, batch_size: int, k: int, decode_only: bool,
                  tokens: int) -> None: ...


def timed_step(prev_step: int, prev_k: int, step: int, k: int, decode_only: bool) -> bool:
    """Whether the time between the commits of `prev_step` and `step` is a decode step time of
    K_eff `k`: consecutive steps, a decode step, the same K_eff as the step before (the first
    step after switching on verifies nothing, the first after switching off still has
    speculative rows)."""
    return decode_only and prev_step == step - 1 and prev_k == k


def bucket(batch_size: int) -> int:
    """The power of two at or above `batch_size`: estimates are kept per bucket."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class MeasuredCostModel:
    saturation_tokens: int = 256  # prior: query tokens at which compute matches weight reads
    window: int = 16  # measurements per (bucket, k) the estimate is the median of
    _times: dict[tuple[int, int], deque[float]] = field(default_factory=dict)
    _measured: dict[tuple[int, int], float] = field(default_factory=dict)  # their medians

    def prior(self, batch_size: int, k: int) -> float:
        return max(1.0, batch_size * (k + 1) / self.saturation_tokens)

    def knows_plain_step(self) -> bool:
        return any(k == 0 for _, k in self._measured)

    def _plain(self, b: int) -> float | None:
        """T(b, 0): measured, else the nearest bucket's measured plain step scaled by the
        prior (None before any plain step is measured)."""
        near = nearest_bucket(b, [bb for bb, k in self._measured if k == 0])
        if near is None:
            return None
        return self._measured[near, 0] * self.prior(b, 0) / self.prior(near, 0)

    def step_time(self, batch_size: int, k: int) -> float:
        b = bucket(batch_size)
        got = self._measured.get((b, k))
        if got is not None:
            return got
        plain = self._plain(b)
        if plain is None:
            return self.prior(batch_size, k)
        return plain * self.prior(b, k) / self.prior(b, 0)

    def observe(self, batch_size: int, k: int, seconds: float) -> None:
        key = (bucket(batch_size), k)
        times = self._times.setdefault(key, deque(maxlen=self.window))
        times.append(seconds)
        self._measured[key] = statistics.median(times)


@dataclass
class AdaptiveSpec:
    k: int  # num_speculative_tokens
    acceptance: SpecDecodingStats  # the engine's running counts (updated at each commit)
    cost: StepCostModel = field(default_factory=MeasuredCostModel)
    clock: Callable[[], float] = time.perf_counter
    margin: float = SWITCH_MARGIN
    guard: RealizedGuard | None = None  # vetoes speculation where it has not paid
    _last_commit: tuple[int, int, float] | None = None  # (step, K_eff, time) of the last commit
    _spec_rows: int = 0  # rows of committed steps that verified drafts (K_eff > 0)

    def expected_tokens(self, k: int) -> float:
        """E'(k): tokens a speculative row emits verifying k drafts, counting the rows that had
        none to verify (one token each)."""
        a = self.acceptance
        runs = a.num_drafts + PRIOR_RUNS
        with_drafts = min(1.0, runs / (self._spec_rows + PRIOR_RUNS))
        per_pos = a.num_accepted_tokens_per_pos
        return 1.0 + with_drafts * sum((per_pos[j] + PRIOR_RUNS * PRIOR_ACCEPT ** (j + 1)) / runs
                                       for j in range(k))

    def choose(self, batch_size: int) -> int:
        """K_eff for a step of `batch_size` speculative rows (ties: fewer drafts; K_eff > 0
        only with a predicted gain over 0 of more than `margin`). 0 until a plain step has
        been timed: the prior's step costs are scaled from it, and K_eff = 0 is timed only
        while the switch chooses it."""
        if not self.cost.knows_plain_step():
            return 0
        if self.guard is not None and not self.guard.allows(bucket(batch_size)):
            return 0
        best, best_rate = 0, (1 + self.margin) / self.cost.step_time(batch_size, 0)
        for k in range(1, self.k + 1):
            rate = self.expected_tokens(k) / self.cost.step_time(batch_size, k)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best

    def committed(self, step: int, batch_size: int, k: int, decode_only: bool,
                  tokens: int) -> None:
        """Step `step` committed `tokens` output tokens: the time since the previous step's
        commit is its step time (the loop commits one step per step time when busy), measured
        by the cost model when that step was a decode step of the same K_eff, by the guard
        for every step."""
        now = self.clock()
        last, self._last_commit = self._last_commit, (step, k, now)
        if k > 0:
            self._spec_rows += batch_size
        if last is None or last[0] != step - 1:
            return
        if timed_step(last[0], last[1], step, k, decode_only):
            self.cost.observe(batch_size, k, now - last[2])
        if self.guard is not None:
            cap = IDLE_CAP * self.cost.step_time(batch_size, 0)
            self.guard.observe(bucket(batch_size), tokens, min(now - last[2], cap))
