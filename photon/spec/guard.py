"""The adaptive switch's realized-rate guard: per batch-size bucket, whether speculating has
actually paid, measured over every committed step.

The cost model (photon.spec.adaptive) rates full decode steps. A speculating batch has costs
such steps leave out: its requests finish on different steps, so their successors' prompts
arrive one by one in mixed steps (outside the speculative graphs: piecewise graphs and eager
attention), the batch runs partial steps more often, and the first step after a switch verifies
nothing. Where the cost model's gain is narrower than those costs the switch loses while
predicting a win. The guard measures the outcome instead of modelling it: for each bucket it
alternates

  PLAIN  `window` committed steps with speculation held off (K_eff = 0),
  SPEC   `window` committed steps with it allowed (the cost model picks K_eff),
  HOLD   the verdict, speculation allowed or vetoed, for `hold` steps of the bucket,

counting every committed step of the bucket (decode, partial and mixed alike): its output
tokens and the time since the previous step's commit. The verdict allows speculation when the
SPEC window's output tokens per second beat the PLAIN window's. The hold doubles while the
verdict repeats, up to `max_hold`, so a settled bucket spends little time in the regime that
loses; a verdict won by more than `clear` (25%) holds `max_hold` at once (at B = 1 speculation
may double the rate: each plain probe then costs half its steps' tokens). After a change of
regime (speculation allowed or not) the next `in_flight` commits belong to steps planned under
the one before (the pipeline plans ahead): they are not counted. The caller caps each step's
seconds (an idle engine between two steps is no step's cost).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

WINDOW = 48  # committed steps per measured window
HOLD = 256  # steps a first verdict holds before both regimes are measured again
MAX_HOLD = 4096
CLEAR = 0.25  # a regime this much faster than the other holds its verdict `max_hold` steps


def nearest_bucket(bucket: int, buckets: Iterable[int]) -> int | None:
    """The bucket of `buckets` nearest `bucket` in powers of two (ties: the smaller; None if
    there is none)."""
    return min(buckets, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b),
               default=None)


class Phase(enum.Enum):
    PLAIN = "plain"
    SPEC = "spec"
    HOLD = "hold"


@dataclass
class _Window:
    seconds: float = 0.0
    tokens: int = 0

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    phase: Phase = Phase.PLAIN
    steps: int = 0  # steps counted in this phase
    skip: int = 0  # commits of steps planned under the previous phase, not counted
    plain: _Window = field(default_factory=_Window)
    spec: _Window = field(default_factory=_Window)
    allow: bool = True  # the verdict HOLD applies
    hold: int = 0  # steps the current HOLD lasts


@dataclass
class RealizedGuard:
    in_flight: int = 1  # steps planned before a commit: plan(t+2) follows commit(t) (both loops)
    window: int = WINDOW
    first_hold: int = HOLD
    max_hold: int = MAX_HOLD
    clear: float = CLEAR
    _buckets: dict[int, _Bucket] = field(default_factory=dict)

    def allows(self, bucket: int) -> bool:
        """Whether the steps of `bucket` may speculate now. A bucket none of whose steps has
        committed takes the nearest measured bucket's state (the switch may be asked about more
        requests than the KV cache lets run: those steps' own bucket then decides), and none
        measured yet means not yet: plain steps are measured first."""
        near = bucket if bucket in self._buckets else nearest_bucket(bucket, self._buckets)
        return near is not None and _allowing(self._buckets[near])

    def verdict(self, bucket: int) -> bool | None:
        """The bucket's last verdict (None before its first pair of windows)."""
        state = self._buckets.get(bucket)
        return None if state is None or state.hold == 0 else state.allow

    def verdicts(self) -> dict[int, bool | None]:
        """Every measured bucket's last verdict."""
        return {b: self.verdict(b) for b in sorted(self._buckets)}

    def observe(self, bucket: int, tokens: int, seconds: float) -> None:
        """A committed step of `bucket`: its output tokens, the seconds it took."""
        state = self._buckets.setdefault(bucket, _Bucket())
        if state.skip:
            state.skip -= 1
            return
        if state.phase is not Phase.HOLD:
            win = state.plain if state.phase is Phase.PLAIN else state.spec
            win.seconds += seconds
            win.tokens += tokens
        state.steps += 1
        if state.phase is Phase.HOLD:
            if state.steps >= state.hold:
                self._enter(state, Phase.PLAIN)
        elif state.steps >= self.window:
            if state.phase is Phase.PLAIN:
                self._enter(state, Phase.SPEC)
            else:
                self._decide(state)

    def _decide(self, state: _Bucket) -> None:
        spec, plain = state.spec.rate(), state.plain.rate()
        allow = spec > plain
        repeat = state.hold and allow == state.allow
        if max(spec, plain) > (1 + self.clear) * min(spec, plain):
            state.hold = self.max_hold  # a clear verdict: probing the loser costs more
        else:
            state.hold = min(2 * state.hold, self.max_hold) if repeat else self.first_hold
        state.allow = allow
        self._enter(state, Phase.HOLD)

    def _enter(self, state: _Bucket, phase: Phase) -> None:
        before = _allowing(state)
        if phase is Phase.PLAIN:
            state.plain, state.spec = _Window(), _Window()
        state.phase, state.steps = phase, 0
        state.skip = self.in_flight if _allowing(state) != before else 0


def _allowing(state: _Bucket) -> bool:
    return state.phase is Phase.SPEC or (state.phase is Phase.HOLD and state.allow)
