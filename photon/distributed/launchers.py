"""The worker launchers behind --distributed-executor-backend: how ranks 1..tp-1 are started,
watched and reaped. `TPWorkers` (rank 0's handle) owns the group and the step broadcast; a
launcher only places the processes that run `worker_main` and says which of them died.

mp (the default): one `multiprocessing` spawn process per rank on this host, rendezvous on the
loopback address. ray: one Ray actor per rank in a placement group (photon.distributed.
ray_launcher), rendezvous on this node's IP so that ranks on other machines reach it.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from photon.config import EngineConfig
    from photon.distributed.group import TPGroupSpec

LOOPBACK = "127.0.0.1"


class WorkerLauncher(Protocol):
    """Starts ranks 1..size-1 running `worker_main`, names the dead ones, reaps them all."""

    def rendezvous_host(self) -> str:
        """The address rank 0's store binds: reachable from every rank's host."""
        ...

    def start(self, config: EngineConfig, spec: TPGroupSpec, engine_id: str) -> None:
        ...

    def dead_ranks(self) -> list[str]:
        """The ranks that exited, as "rank R (why)" (for the error that ends the engine)."""
        ...

    def reap(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the ranks to exit (after the stop message), then kill
        the rest and release what the launcher holds. Idempotent."""
        ...


class ProcessLauncher:
    """mp: spawned processes (a clean interpreter on any platform), daemonic, on this host."""

    def __init__(self) -> None:
        self.procs: list[mp.Process] = []

    def rendezvous_host(self) -> str:
        return LOOPBACK

    def start(self, config: EngineConfig, spec: TPGroupSpec, engine_id: str) -> None:
        from photon.distributed.workers import worker_main

        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(config, spec, rank, engine_id),
                                  daemon=True, name=f"photon-tp-rank{rank}")
                      for rank in range(1, spec.size)]
        for p in self.procs:
            p.start()

    def dead_ranks(self) -> list[str]:
        return [f"rank {i + 1} (exit code {p.exitcode})"
                for i, p in enumerate(self.procs) if not p.is_alive()]

    def reap(self, timeout_s: float) -> None:
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join(5.0)


def create_launcher(backend: str, device: str) -> WorkerLauncher:
    """The launcher of `backend` (one of photon.config.EXECUTOR_BACKENDS, checked there)."""
    if backend == "ray":
        from photon.distributed.ray_launcher import RayLauncher

        return RayLauncher(device)
    return ProcessLauncher()
