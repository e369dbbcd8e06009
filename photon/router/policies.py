"""Routing policies: pure choices over the healthy backends' loads and cached prefixes.

A policy sees `Candidate`s (a backend's URL, its load, and how many leading blocks of the
request's prompt it already caches) and returns a `Decision`. It does no I/O and reads no clock;
its only state is a rotation counter for breaking ties, so that equal backends share the work.

- round_robin: each backend in turn.
- least_load: the smallest load (outstanding requests; see BackendPool.load).
- prefix_aware: the smallest cost = prefix_weight * (prompt blocks not cached there) + load, as
  Dynamo's KV router scores workers. Ties fall back to least load, and so does overload: when the
  cheapest backend's load exceeds the least loaded one's by more than `balance_threshold`, the
  request goes to the least loaded one (as SGLang's cache-aware router rebalances).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from photon.registry import Registry


@dataclass(frozen=True)
class Candidate:
    url: str
    load: float  # outstanding requests (or the backend's own running + waiting, if larger)
    cached_blocks: int = 0  # leading prompt blocks the backend already holds


@dataclass(frozen=True)
class Decision:
    url: str
    reason: str  # round_robin | least_load | prefix | tie | overload (a metrics label)
    cached_blocks: int = 0


@dataclass(frozen=True)
class PolicyConfig:
    prefix_weight: float = 0.1  # load units per prompt block that must be prefilled
    balance_threshold: float = 8.0  # extra load over the least loaded backend that is overload


POLICIES: Registry[type[Policy]] = Registry("routing policy")


class Policy:
    name = ""
    uses_prefix = False  # True: the caller fills Candidate.cached_blocks

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate], num_blocks: int = 0) -> Decision:
        raise NotImplementedError

    def _rotate(self, candidates: Sequence[Candidate]) -> Candidate:
        """The next of `candidates` in rotation (they are non-empty)."""
        pick = candidates[self._turn % len(candidates)]
        self._turn += 1
        return pick

    def _least_load(self, candidates: Sequence[Candidate], reason: str) -> Decision:
        low = min(c.load for c in candidates)
        pick = self._rotate([c for c in candidates if c.load == low])
        return Decision(pick.url, reason, pick.cached_blocks)


@POLICIES.register("round_robin")
class RoundRobin(Policy):
    def choose(self, candidates: Sequence[Candidate], num_blocks: int = 0) -> Decision:
        pick = self._rotate(candidates)
        return Decision(pick.url, "round_robin", pick.cached_blocks)


@POLICIES.register("least_load")
class LeastLoad(Policy):
    def choose(self, candidates: Sequence[Candidate], num_blocks: int = 0) -> Decision:
        return self._least_load(candidates, "least_load")


def prefix_cost(candidate: Candidate, num_blocks: int, weight: float) -> float:
    """Dynamo's score: the prefill still to do (blocks not cached there) plus the decode load."""
    return weight * max(0, num_blocks - candidate.cached_blocks) + candidate.load


@POLICIES.register("prefix_aware")
class PrefixAware(Policy):
    uses_prefix = True

    def choose(self, candidates: Sequence[Candidate], num_blocks: int = 0) -> Decision:
        cfg = self.config
        if max(c.cached_blocks for c in candidates) == 0:
            return self._least_load(candidates, "least_load")
        costs = [prefix_cost(c, num_blocks, cfg.prefix_weight) for c in candidates]
        best = min(costs)
        cheapest = [c for c, cost in zip(candidates, costs) if cost == best]
        if len(cheapest) > 1:
            return self._least_load(cheapest, "tie")
        pick = cheapest[0]
        if pick.load - min(c.load for c in candidates) > cfg.balance_threshold:
            return self._least_load(candidates, "overload")
        return Decision(pick.url, "prefix", pick.cached_blocks)


def make_policy(name: str, config: PolicyConfig | None = None) -> Policy:
    """The policy registered as `name`; ValueError listing the known names otherwise."""
    return POLICIES.get(name)(config)
