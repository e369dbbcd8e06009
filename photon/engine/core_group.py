"""The engine cores behind one front end: one, or N with `--data-parallel-size N`.

Each core is a process of its own with its own scheduler, KV cache and model runner (and, with
`--tensor-parallel-size`, its own ranks). `CoreGroup` sends each new request to the core with the
least load: the requests the front end sent there whose final output it has not seen yet
(running + waiting, as far as the front end can tell); ties go to the lowest index. It remembers
each live request's core, so aborts (of a request, or of one of the children of an n > 1
request: they all run on their parent's core) go there.

Without expert parallelism the cores never talk to each other: nothing needs them to step
together. With `--enable-expert-parallel` on an MoE model the experts span the cores
(photon.distributed.dp_experts: data-parallel attention, expert-parallel MoE layers) and the cores
step in lockstep (photon.engine.lockstep), a core without work running dummy steps. Their group
meets at a TCPStore this front end binds on a free port of the loopback address before it starts
the cores (the address travels in each core's config); the store lives until `close`. Every
`AddRequest` to one such core comes with a `Wake` to every other core (`others`), so that idle
cores join the steps of the one that got the request; `close` sends every core its `Shutdown`
before it waits for any, as the cores stop together.

On CUDA core i sees GPUs i*tp .. i*tp+tp-1 of this process's visible devices
(CUDA_VISIBLE_DEVICES), so that its ranks number them from 0 as a single core does.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from photon.config import ConfigError, EngineConfig
from photon.engine.core_client import CoreClient, CoreGoneError
from photon.engine.engine_core import EngineStats
from photon.engine.messages import Shutdown
from photon.kv_transfer.metadata import KVTransferStats
from photon.lora.manager import LoRAStats
from photon.spec.stats import SpecDecodingStats


class CoreGroup:
    """The cores and which of them owns each live request. Not thread-safe: the front end
    calls `assign`, `release` and `clear` under its own lock."""

    def __init__(self, clients: list[CoreClient], lockstep: bool = False,
                 store: Any = None) -> None:
        self.clients = clients
        self.lockstep = lockstep  # the cores step together (experts span them)
        self._store = store  # the lockstep cores' rendezvous, kept alive while they run
        self._owner: dict[str, int] = {}  # the core's request id -> index of its core
        self._load = [0] * len(clients)  # live requests per core

    @classmethod
    def spawn(cls, config: EngineConfig) -> CoreGroup:
        """Start `data_parallel_size` cores (all at once) and wait until each is ready."""
        size = config.parallel.data_parallel_size
        if size == 1:
            return cls([CoreClient.spawn(config)])
        store = None
        if config.parallel.experts_span_cores:
            store, config = bind_expert_store(config)
        clients: list[CoreClient] = []
        try:
            for rank in range(size):
                clients.append(CoreClient.start(with_rank(config, rank), core_env(config, rank)))
            for client in clients:
                client.wait_ready()
        except BaseException:
            cls(clients, store is not None, store).close()
            raise
        return cls(clients, store is not None, store)

    @property
    def loads(self) -> list[int]:
        return list(self._load)

    def assign(self, request_id: str) -> CoreClient:
        """The least-loaded core, now owning `request_id`."""
        index = min(range(len(self.clients)), key=lambda i: (self._load[i], i))
        self._owner[request_id] = index
        self._load[index] += 1
        return self.clients[index]

    def owner(self, request_id: str) -> CoreClient | None:
        index = self._owner.get(request_id)
        return None if index is None else self.clients[index]

    def release(self, request_id: str) -> None:
        """`request_id` finished (its final output was seen); unknown ids are ignored."""
        index = self._owner.pop(request_id, None)
        if index is not None:
            self._load[index] -= 1

    def clear(self) -> None:
        self._owner.clear()
        self._load = [0] * len(self.clients)

    @property
    def alive(self) -> bool:
        return all(client.alive for client in self.clients)

    def first_dead(self) -> CoreClient | None:
        return next((client for client in self.clients if not client.alive), None)

    def others(self, client: CoreClient) -> list[CoreClient]:
        """The lockstep cores to wake when `client`'s core is sent a request (none otherwise)."""
        return [c for c in self.clients if c is not client] if self.lockstep else []

    def close(self) -> None:
        if self.lockstep:  # every core is told before any is waited for: they stop together
            for client in self.clients:
                try:
                    if client.alive:
                        client.send(Shutdown(), block=False)
                except CoreGoneError:
                    pass
        for client in self.clients:
            client.close()
        self._store = None


def bind_expert_store(config: EngineConfig) -> tuple[Any, EngineConfig]:
    """The lockstep cores' rendezvous: a TCPStore on a free loopback port, and the config that
    names it to the cores."""
    from photon.distributed.group import bind_store

    parallel = config.parallel
    host = "127.0.0.1"
    store = bind_store(host, parallel.data_parallel_size, parallel.collective_timeout_s)
    named = dataclasses.replace(parallel, data_parallel_master_ip=host,
                                data_parallel_master_port=store.port)
    return store, dataclasses.replace(config, parallel=named)


def visible_devices_for(visible: list[str], tp: int, dp: int, rank: int) -> str:
    """The CUDA_VISIBLE_DEVICES of data-parallel core `rank` (ConfigError if too few GPUs)."""
    if len(visible) < tp * dp:
        raise ConfigError(
            f"data_parallel_size (--data-parallel-size) = {dp} x tensor_parallel_size = {tp} "
            f"needs {tp * dp} GPUs; {len(visible)} are visible")
    return ",".join(visible[rank * tp:(rank + 1) * tp])


def with_rank(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of data-parallel core `rank` (its KV events carry the rank, on port + rank)."""
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                    data_parallel_rank=rank))


def core_env(config: EngineConfig, rank: int) -> dict[str, str] | None:
    """The environment of data-parallel core `rank`: its own GPUs on CUDA (None: inherit)."""
    if config.device != "cuda":
        return None
    import torch

    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = given.split(",") if given else [str(i) for i in range(torch.cuda.device_count())]
    parallel = config.parallel
    devices = visible_devices_for(visible, parallel.tensor_parallel_size,
                                  parallel.data_parallel_size, rank)
    return {**os.environ, "CUDA_VISIBLE_DEVICES": devices}


def combine_stats(stats: list[EngineStats]) -> EngineStats:
    """The whole engine's stats from each core's latest: counts and cumulative counters add up,
    the KV cache usage is the mean (the cores have caches of one size)."""
    if len(stats) == 1:
        return stats[0]
    specs = [s.spec_decoding for s in stats if s.spec_decoding is not None]
    return EngineStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        num_evictable_blocks=sum(s.num_evictable_blocks for s in stats),
        prefix_queries=sum(s.prefix_queries for s in stats),
        prefix_hits=sum(s.prefix_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        spec_decoding=_combine_spec(specs) if specs else None,
        kv_events_dropped=sum(s.kv_events_dropped for s in stats),
        kv_transfer=_combine_kv_transfer([s.kv_transfer for s in stats
                                          if s.kv_transfer is not None]),
        lora=_combine_lora([s.lora for s in stats if s.lora is not None]),
    )


def _combine_lora(parts: list[LoRAStats]) -> LoRAStats | None:
    """Every core's adapters and slots (max_lora: --max-loras, the slots of each core)."""
    if not parts:
        return None
    return LoRAStats(sorted({n for p in parts for n in p.running_adapters}),
                     sorted({n for p in parts for n in p.waiting_adapters}),
                     parts[0].max_lora, sum(p.slots_used for p in parts),
                     sum(p.slots_loaded for p in parts), sum(p.num_slot_loads for p in parts),
                     max(p.adapters_version for p in parts))


def _combine_kv_transfer(parts: list[KVTransferStats]) -> KVTransferStats | None:
    if not parts:
        return None
    total = parts[0].copy()
    for p in parts[1:]:
        for name, value in vars(p).items():
            if name != "role":
                setattr(total, name, getattr(total, name) + value)
    return total


def _combine_spec(specs: list[SpecDecodingStats]) -> SpecDecodingStats:
    total = dataclasses.replace(specs[0], num_accepted_tokens_per_pos=list(
        specs[0].num_accepted_tokens_per_pos))
    for s in specs[1:]:
        total.num_drafts += s.num_drafts
        total.num_draft_tokens += s.num_draft_tokens
        total.num_accepted_tokens += s.num_accepted_tokens
        per_pos = total.num_accepted_tokens_per_pos
        for i, v in enumerate(s.num_accepted_tokens_per_pos):
            if i < len(per_pos):
                per_pos[i] += v
            else:
                per_pos.append(v)
    return total
