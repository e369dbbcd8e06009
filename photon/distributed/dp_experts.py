"""The expert-parallel group that spans the data-parallel engine cores (`--data-parallel-size N
--enable-expert-parallel`): data-parallel attention, expert-parallel MoE layers (vLLM's layout).

Each core (one rank: attention tp = 1) runs its own batch through attention and the dense
layers; the MoE layers' experts are partitioned over the N cores, core r holding experts
[r*E/N, (r+1)*E/N). An MoE layer dispatches by all-gather and combines by reduce-scatter:
  1. the core routes its own T_r tokens (the router is replicated) and pads them to the
     forward's agreed count P = max over the cores of T_r (pad rows route nowhere: expert id -1,
     weight 0, so they cost no expert work);
  2. all-gather the padded tokens and their routing: [N*P, H], every core sees every token;
  3. each core applies its experts to the tokens routed to them (zero for the other slots);
  4. reduce-scatter (sum) the [N*P, H] partial outputs: core r receives rows [r*P, (r+1)*P),
     the whole output of its own tokens, and keeps the first T_r.
P is agreed once per forward, before the first layer (`begin_forward`: one host all-reduce on the
group's gloo CPU group), so every layer's collectives have one shape on every core.

Every core must therefore run the same number of forwards: the cores step in lockstep, a core
without work running dummy steps (photon.engine.lockstep, whose per-step agreement `agree` is
here too).

The group is a `TPGroup` joined through the rendezvous the front end chose (a TCPStore it bound
on a free port: ParallelConfig.data_parallel_master_ip / _port); the model's collectives are NCCL
on CUDA, gloo on CPU. Every collective has the group's timeout
(ParallelConfig.collective_timeout_s): a core that died or hangs makes the others fail with
`ExpertParallelError` within it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from photon.config import EngineConfig, ParallelConfig
from photon.distributed.group import TPGroup, TPGroupSpec

T = TypeVar("T")


def join_dp_experts(config: EngineConfig) -> DPExperts | None:
    """This core's place in the group when the experts span the data-parallel cores (else None).
    On CPU the cores share the host's cores: each takes its share of threads (a collective waits
    for the slowest core, and oversubscribed threads spin)."""
    parallel = config.parallel
    if not parallel.experts_span_cores:
        return None
    if config.device != "cuda":
        from photon.distributed.workers import cpu_threads_per_rank

        torch.set_num_threads(cpu_threads_per_rank(parallel.data_parallel_size))
    return DPExperts.join(parallel, config.device)


class ExpertParallelError(RuntimeError):
    """An engine core of the expert-parallel group died or stopped answering: this core stops."""


@dataclass(frozen=True)
class Round:
    """The cores' agreement at the start of a lockstep round (photon.engine.lockstep)."""

    any_work: bool  # some core has a step to run: every core runs one forward
    min_wakeups: int  # the fewest wake-up messages a core has received
    max_wakeups: int
    stop: bool  # some core was told to shut down: every core's loop ends

    @property
    def settled(self) -> bool:
        """Nothing to run and every core has seen every wake-up: all may idle."""
        return not self.any_work and self.min_wakeups == self.max_wakeups


class DPExperts:
    """One core's view of the group: the collectives of the MoE layers and of the lockstep."""

    def __init__(self, group: TPGroup, timeout_s: float) -> None:
        self.group = group
        self.timeout_s = timeout_s
        # Invariant: set by begin_forward at the top of each forward, read by its MoE layers.
        self.padded = 0
        self.num_forwards = 0  # forwards begun: the lockstep loop counts its step's forwards

    @classmethod
    def join(cls, parallel: ParallelConfig, device: str) -> DPExperts:
        """Join as core `data_parallel_rank` (blocks until every core joined, or times out)."""
        spec = TPGroupSpec(parallel.data_parallel_master_ip, parallel.data_parallel_master_port,
                           parallel.data_parallel_size, parallel.collective_timeout_s, device)
        rank = parallel.data_parallel_rank
        try:
            return cls(TPGroup.join(spec, rank), spec.timeout_s)
        except RuntimeError as e:
            raise ExpertParallelError(
                f"engine core {rank} could not join the expert-parallel group of the "
                f"{spec.size} data-parallel cores within {spec.timeout_s:g} s (a core failed to "
                f"start?): {type(e).__name__}: {e}") from e

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    def agree(self, has_work: bool, wakeups: int, stopping: bool) -> Round:
        """A lockstep round's agreement: whether any core has work or stops, and the range of
        the cores' wake-up counts (one host all-reduce)."""
        work, most, neg_least, stop = self._guard(
            lambda: self.group.max_ints([int(has_work), wakeups, -wakeups, int(stopping)]))
        return Round(bool(work), -neg_least, most, bool(stop))

    def begin_forward(self, num_tokens: int) -> None:
        """Agree on this forward's padded token count (the most tokens any core runs)."""
        self.padded = self._guard(lambda: self.group.max_int(num_tokens))
        self.num_forwards += 1

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This core's tokens x [T, H] and their routing (weights float32, global expert ids
        int64, [T, k]) -> every core's, padded: [N*P, H], [N*P, k], [N*P, k]."""
        pad = self.padded - x.shape[0]
        if pad < 0:
            raise RuntimeError(f"MoE layer got {x.shape[0]} tokens, more than the forward's "
                               f"agreed {self.padded} (begin_forward not called?)")
        k = ids.shape[1]
        x = F.pad(x, (0, 0, 0, pad))
        # One gather for the routing: ids as float32 are exact (expert ids < 2**24).
        routing = torch.cat([F.pad(weights.float(), (0, 0, 0, pad)),
                             F.pad(ids.float(), (0, 0, 0, pad), value=-1.0)], dim=1)
        xs = self._guard(lambda: self.group.all_gather(x, dim=0))
        routing = self._guard(lambda: self.group.all_gather(routing, dim=0))
        return xs, routing[:, :k], routing[:, k:].long()

    def combine(self, out: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Every core's partial outputs [N*P, H] summed; this core's first `num_tokens` rows."""
        return self._guard(lambda: self.group.reduce_scatter(out))[:num_tokens]

    def _guard(self, op: Callable[[], T]) -> T:
        """Run a collective; a failed one (a core died, or none answered within the timeout)
        raises ExpertParallelError."""
        try:
            return op()
        except RuntimeError as e:
            raise ExpertParallelError(
                f"the expert-parallel group of the data-parallel engine cores failed: a core "
                f"exited or did not answer within {self.timeout_s:g} s; this core (rank "
                f"{self.group.rank}) stops ({type(e).__name__}: {e})") from e
