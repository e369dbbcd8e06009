"""--distributed-executor-backend ray: ranks 1..tp-1 as Ray actors, placed by a placement group.

The engine joins the Ray instance the process already initialised, else `ray.init()`: the
cluster RAY_ADDRESS names, else the one `ray start` runs on this machine, else a new local
instance (which it shuts down with the workers). The placement group has one bundle per rank
({"GPU": 1} on CUDA, {"CPU": 1} on CPU), strategy PACK; bundle 0 is rank 0's (this process, on
this node: it reserves its device so no worker is given it) and bundle r holds rank r's actor.
Each actor's one call runs the rank's loop (`run_rank`) for the engine's life; reaping waits for
those calls to return after the stop message, kills the actors and removes the placement group.
The rendezvous binds this node's IP, so ranks on other machines reach it.

Only this module imports ray (lazily: the mp backend never needs it).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from photon.config import ConfigError, flag

if TYPE_CHECKING:
    from photon.config import EngineConfig
    from photon.distributed.group import TPGroupSpec

_DEAD_WAIT_S = 5.0  # how long a failed collective waits for Ray to report which actor died
_NODE_SHARE = 0.001  # of the built-in "node:<ip>" resource: pins bundle 0 to this node


def _missing() -> ConfigError:
    return ConfigError(f"{flag('distributed_executor_backend')}=ray needs the ray package: "
                       f"pip install ray (or pip install 'photon[ray]'); or use mp")


def check_ray_installed() -> None:
    """ConfigError saying how to install ray when it is not (without importing it)."""
    if importlib.util.find_spec("ray") is None:
        raise _missing()


def import_ray() -> Any:
    """The ray package, or a ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise _missing() from None
    return ray


class _RankActor:
    """One rank in a Ray actor (decorated with ray.remote when launched)."""

    def run(self, config: EngineConfig, spec: TPGroupSpec, rank: int, engine_id: str) -> None:
        from photon.distributed.workers import run_rank

        # Ray sets CUDA_VISIBLE_DEVICES to the bundle's one GPU: it is device 0 here.
        run_rank(config, spec, rank, engine_id, cuda_index=0)


class RayLauncher:
    def __init__(self, device: str) -> None:
        self.ray = import_ray()
        self.device = device
        self.owns_ray = not self.ray.is_initialized()
        if self.owns_ray:
            self.ray.init()
        self.actors: list[Any] = []
        self.refs: list[Any] = []
        self.placement_group: Any = None

    def rendezvous_host(self) -> str:
        return self.ray.util.get_node_ip_address()

    def start(self, config: EngineConfig, spec: TPGroupSpec, engine_id: str) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.placement_group = self._place(spec.size, spec.timeout_s)
        resources = {"num_gpus": 1, "num_cpus": 0} if self.device == "cuda" else {"num_cpus": 1}
        actor_class = self.ray.remote(_RankActor)
        for rank in range(1, spec.size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=rank)
            actor = actor_class.options(scheduling_strategy=strategy, **resources).remote()
            self.actors.append(actor)
            self.refs.append(actor.run.remote(config, spec, rank, engine_id))

    def _place(self, size: int, timeout_s: float) -> Any:
        """The placement group, ready (ConfigError if the cluster cannot hold it in time)."""
        from ray.util.placement_group import placement_group

        unit = "GPU" if self.device == "cuda" else "CPU"
        node = f"node:{self.rendezvous_host()}"
        bundles = [{unit: 1.0, node: _NODE_SHARE}] + [{unit: 1.0} for _ in range(1, size)]
        group = placement_group(bundles, strategy="PACK")
        ready, _ = self.ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            self.ray.util.remove_placement_group(group)
            raise ConfigError(
                f"{flag('distributed_executor_backend')}=ray: the Ray cluster could not place "
                f"{size} ranks ({size} bundles of {{'{unit}': 1}}) within {timeout_s:g} s; its "
                f"resources: {self.ray.cluster_resources()}")
        return group

    def dead_ranks(self) -> list[str]:
        if not self.refs:
            return []
        done, _ = self.ray.wait(self.refs, num_returns=len(self.refs), timeout=_DEAD_WAIT_S)
        return [f"rank {i + 1} ({self._why(ref)})" for i, ref in enumerate(self.refs)
                if ref in done]

    def _why(self, ref: Any) -> str:
        try:
            self.ray.get(ref)
        except self.ray.exceptions.RayActorError:
            return "its Ray actor died"
        except self.ray.exceptions.RayTaskError as e:
            return f"raised {type(e.cause).__name__}: {e.cause}"
        return "stopped"

    def reap(self, timeout_s: float) -> None:
        ray = self.ray
        if not ray.is_initialized():
            return  # the instance is gone, and its actors and placement groups with it
        if self.refs:
            ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor)  # also after a clean stop: skips the teardown of the gloo group
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
        self.actors, self.refs, self.placement_group = [], [], None
        if self.owns_ray:
            self.owns_ray = False
            ray.shutdown()
