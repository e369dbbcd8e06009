"""The adaptive switch: how many drafts a step verifies, chosen per step on the host.

Each step the scheduler asks `AdaptiveSpec.choose(B)` for K_eff in 0..K, the drafts every
speculative row of the step verifies (B: the requests the step may run). It maximises tokens per
second,

    E(k) / T(B, k),   E(k) = 1 + sum_{j < k} a_j,

where a_j is the share of draft runs whose draft j was accepted (the engine's running
per-position counts, `SpecDecodingStats`; prior pseudo-counts before any exist) and T(B, k) the
step time a `StepCostModel` predicts for B rows verifying k drafts. K_eff = 0 is the plain
decode step: the scheduler plans plain rows for the requests whose length the host knows. It
speculates (K_eff > 0) only when the best rate beats the plain step's, 1 / T(B, 0), by more
than `SWITCH_MARGIN`: a speculating batch has costs its decode-step times leave out (requests
finish on different steps, so refills land in mixed steps beside speculative rows; the first
step after a switch verifies nothing), so a K_eff the model rates about even with 0 loses.

`MeasuredCostModel`, the default, keeps an online estimate of T per (batch-size bucket, k) from
the times between consecutive committed decode steps, and predicts unmeasured entries with a
roofline-style prior: a step streams the weights once (a fixed cost) until its query tokens
B * (k + 1) saturate the compute units, then grows with them. The prior is scaled by the
measured entries of the same bucket (or any bucket), so one measurement calibrates the rest.
Everything is host data: the decision never synchronises with the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from photon.spec.stats import SpecDecodingStats

PRIOR_RUNS = 8  # pseudo draft runs of the acceptance prior
PRIOR_ACCEPT = 0.6  # prior acceptance of each draft given the previous ones
SWITCH_MARGIN = 0.1  # K_eff > 0 must beat the plain step's predicted rate by this fraction


class StepCostModel(Protocol):
    """Predicted seconds of a decode step of `batch_size` rows verifying `k` drafts each."""

    def step_time(self, batch_size: int, k: int) -> float: ...

    def observe(self, batch_size: int, k: int, seconds: float) -> None: ...


class SpecPolicy(Protocol):
    """The scheduler's hook: K_eff per step, and each committed step's shape."""

    def choose(self, batch_size: int) -> int: ...

    def committed(self, step: int, batch_size: int, k: int, decode_only: bool) -> None: ...


def bucket(batch_size: int) -> int:
    """The power of two at or above `batch_size`: estimates are kept per bucket."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class MeasuredCostModel:
    saturation_tokens: int = 256  # prior: query tokens at which compute matches weight reads
    smoothing: float = 0.25  # weight of a new measurement in the running estimate
    _measured: dict[tuple[int, int], float] = field(default_factory=dict)

    def prior(self, batch_size: int, k: int) -> float:
        return max(1.0, batch_size * (k + 1) / self.saturation_tokens)

    def step_time(self, batch_size: int, k: int) -> float:
        b = bucket(batch_size)
        got = self._measured.get((b, k))
        if got is not None:
            return got
        same = [(kk, t) for (bb, kk), t in self._measured.items() if bb == b]
        ref = same or [(kk, t * self.prior(b, kk) / self.prior(bb, kk))
                       for (bb, kk), t in self._measured.items()]
        if not ref:
            return self.prior(batch_size, k)
        kk, t = ref[0]
        return t * self.prior(b, k) / self.prior(b, kk)

    def observe(self, batch_size: int, k: int, seconds: float) -> None:
        key = (bucket(batch_size), k)
        old = self._measured.get(key)
        self._measured[key] = seconds if old is None else (
            old + self.smoothing * (seconds - old))


@dataclass
class AdaptiveSpec:
    k: int  # num_speculative_tokens
    acceptance: SpecDecodingStats  # the engine's running counts (updated at each commit)
    cost: StepCostModel = field(default_factory=MeasuredCostModel)
    clock: Callable[[], float] = time.perf_counter
    margin: float = SWITCH_MARGIN
    _last_commit: tuple[int, float] | None = None  # (step number, time) of the last commit

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a speculative row emits verifying k drafts."""
        a = self.acceptance
        runs = a.num_drafts + PRIOR_RUNS
        per_pos = a.num_accepted_tokens_per_pos
        return 1.0 + sum((per_pos[j] + PRIOR_RUNS * PRIOR_ACCEPT ** (j + 1)) / runs
                         for j in range(k))

    def choose(self, batch_size: int) -> int:
        """K_eff for a step of `batch_size` speculative rows (ties: fewer drafts; K_eff > 0
        only with a predicted gain over 0 of more than `margin`)."""
        best, best_rate = 0, (1 + self.margin) / self.cost.step_time(batch_size, 0)
        for k in range(1, self.k + 1):
            rate = self.expected_tokens(k) / self.cost.step_time(batch_size, k)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best

    def committed(self, step: int, batch_size: int, k: int, decode_only: bool) -> None:
        """Step `step` committed: the time since the previous step's commit is its step time
        (the loop commits one step per step time when busy)."""
        now = self.clock()
        last, self._last_commit = self._last_commit, (step, now)
        if decode_only and last is not None and last[0] == step - 1:
            self.cost.observe(batch_size, k, now - last[1])
