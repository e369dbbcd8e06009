"""The worker processes of ranks 1..tp-1 and the driver that feeds them one message per step.

Rank 0 runs in the engine core's process (in `LLM`'s process, or the core process of `photon
serve`): its `ModelRunner` is driven by the pipeline through `PlanBroadcast`, which broadcasts
each `StepPlan` once, as msgspec bytes over the group's gloo CPU group, before staging it. Each
worker (spawned, so it starts from a clean interpreter on any platform) builds its own
`ModelRunner` over its shard and, per plan, runs prepare, launch and sample: the same steps in
the same order as rank 0, so the model's collectives pair up. The broadcast rides the group's own
transport (no second channel whose ordering against the collectives would need checking, and a
dead rank 0 closes it at once); a zmq PUB socket could drop a slow joiner's first messages.

Message bytes: b"P" + a msgpack StepPlan, b"A" (audit: report the table's live rows and pending
KV transfers), b"K" (KV transfers: every rank reports what its connector finished, all-gathered;
sent only while a transfer waits for a rank, see photon.distributed.kv_reports), b"H" (at start:
every rank's KV connector handshake metadata, all-gathered as JSON), b"S" stop.
Workers exit on stop, or when rank 0's sockets close (its process ended); rank 0 maps a failed
collective to `TensorParallelError` naming the ranks that exited. Where the workers run (spawned
processes, or Ray actors) is the launcher's business (photon.distributed.launchers).
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from typing import Any

import msgspec
import torch

from photon.config import ConfigError, EngineConfig
from photon.core.step import StepPlan
from photon.distributed.group import TPGroup, TPGroupSpec, bind_store
from photon.distributed.kv_reports import RankedConnector, take_report
from photon.distributed.launchers import ProcessLauncher, WorkerLauncher, create_launcher
from photon.kv_transfer.base import KVConnectorBase, KVConnectorRole, create_connector
from photon.kv_transfer.metadata import KVTransferReport

_PLAN, _AUDIT, _KV, _HANDSHAKE, _STOP = b"P", b"A", b"K", b"H", b"S"
_IDLE_WAIT_S = 365 * 24 * 3600.0  # a worker waits this long for the next plan (an idle engine)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on."""


class TPWorkers:
    """Rank 0's handle on the worker processes and the group they share with it."""

    def __init__(self, config: EngineConfig, engine_id: str = "") -> None:
        """`engine_id`: the instance's (rank 0's) id, which names the KV connector's transfers
        on every rank."""
        parallel = config.parallel
        size = parallel.tensor_parallel_size
        self.launcher: WorkerLauncher = create_launcher(parallel.distributed_executor_backend,
                                                        config.device)
        host = self.launcher.rendezvous_host()
        store = bind_store(host, size, parallel.collective_timeout_s)
        spec = TPGroupSpec(host, store.port, size, parallel.collective_timeout_s, config.device)
        # On CPU the ranks share the host's cores; rank 0 (this process) takes its share too,
        # until shutdown() gives the process its threads back.
        self._saved_threads = None if config.device == "cuda" else torch.get_num_threads()
        if self._saved_threads is not None:
            torch.set_num_threads(cpu_threads_per_rank(size))
        # Reaps the workers if the engine is dropped without shutdown() (or at exit).
        self._finalizer = weakref.finalize(self, self.launcher.reap, 0.0)
        try:
            self.launcher.start(config, spec, engine_id)
            self.group: TPGroup | None = TPGroup.join(spec, 0, store)
        except Exception as e:
            self._finalizer()
            self._restore_threads()
            if isinstance(e, ConfigError):  # e.g. the Ray cluster cannot place the ranks
                raise
            raise TensorParallelError(f"tensor-parallel workers did not join: {e}") from e
        self._encoder = msgspec.msgpack.Encoder()
        self._reports = msgspec.msgpack.Decoder(KVTransferReport)

    @property
    def procs(self) -> list[Any]:
        """The worker processes of the mp backend (none under ray: its ranks are actors)."""
        return self.launcher.procs if isinstance(self.launcher, ProcessLauncher) else []

    def send_plan(self, plan: StepPlan) -> None:
        self._send(_PLAN + self._encoder.encode(plan))

    def audit(self) -> tuple[int, int]:
        """The most request-table rows, and KV transfers not yet reported, any worker still
        holds (both 0 after a drain)."""
        self._send(_AUDIT)
        return self._guard(lambda g: (g.max_int(0), g.max_int(0)))

    def kv_reports(self) -> list[KVTransferReport]:
        """What each worker's KV connector finished since it was last asked (rank order)."""
        self._send(_KV)
        parts = self._guard(lambda g: g.all_gather_bytes(b""))
        return [self._reports.decode(part) for part in parts[1:]]

    def kv_handshakes(self) -> list[dict[str, Any] | None]:
        """Each worker's KV connector handshake metadata (rank order; None: it has none)."""
        self._send(_HANDSHAKE)
        parts = self._guard(lambda g: g.all_gather_bytes(b"null"))
        return [json.loads(part) for part in parts[1:]]

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell the workers to stop and reap them (those that do not exit are killed)."""
        if self.group is not None:
            try:
                self.group.broadcast_bytes(_STOP)
            except RuntimeError:
                pass  # a worker died: reaped below
        self.group = None
        self._finalizer.detach()
        self.launcher.reap(timeout_s)
        self._restore_threads()

    def _restore_threads(self) -> None:
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None

    def _send(self, data: bytes) -> None:
        self._guard(lambda g: g.broadcast_bytes(data))

    def _guard(self, op: Any) -> Any:
        if self.group is None:
            raise TensorParallelError("the tensor-parallel workers were shut down")
        try:
            return op(self.group)
        except RuntimeError as e:
            raise self.failure(e) from e

    def failure(self, cause: BaseException) -> TensorParallelError:
        """The error that ends the engine after a collective failed (names the dead ranks)."""
        dead = self.launcher.dead_ranks()
        self.group = None  # broken: never used again
        who = ", ".join(dead) if dead else "a rank stopped answering"
        return TensorParallelError(f"tensor-parallel worker failed: {who}; the engine stops "
                                   f"({type(cause).__name__}: {cause})")


def cpu_threads_per_rank(size: int) -> int:
    """Torch threads of each of `size` CPU ranks: the host's cores split evenly (at least one).
    More would oversubscribe the cores: a rank's idle intra-op threads keep spinning while the
    other ranks compute, and every collective waits for the slowest rank."""
    return max(1, (os.cpu_count() or 1) // size)


class PlanBroadcast:
    """The pipeline's `StepRunner` on rank 0: each plan goes to the workers, then to the runner;
    a failed collective ends the engine with `TensorParallelError`. With a KV connector
    (`kv`), the workers' finished transfers are collected before a plan goes out."""

    def __init__(self, runner: Any, workers: TPWorkers, kv: RankedConnector | None = None
                 ) -> None:
        self.runner = runner
        self.workers = workers
        self.kv = kv

    def prepare(self, plan: StepPlan) -> Any:
        if self.kv is not None:
            self.kv.collect_reports()
        self.workers.send_plan(plan)
        return self.runner.prepare(plan)

    def launch(self, prepared: Any) -> Any:
        try:
            return self.runner.launch(prepared)
        except RuntimeError as e:  # the forward's collectives
            raise self.workers.failure(e) from e

    def sample(self, handle: Any) -> None:
        self.runner.sample(handle)

    def sync(self, handle: Any) -> None:
        self.runner.sync(handle)

    def wait(self, handle: Any) -> Any:
        return self.runner.wait(handle)

    def sampled_ids(self, handle: Any) -> Any:
        return self.runner.sampled_ids(handle)

    def prompt_scores(self, handle: Any) -> Any:
        return self.runner.prompt_scores(handle)


def worker_main(config: EngineConfig, spec: TPGroupSpec, rank: int, engine_id: str) -> None:
    """A worker process of the mp backend (device `rank` of this host on CUDA)."""
    run_rank(config, spec, rank, engine_id, cuda_index=rank)
    # Stopped cleanly: leave without running the interpreter's teardown, which can abort on the
    # process group's transport threads.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(config: EngineConfig, spec: TPGroupSpec, rank: int, engine_id: str,
             cuda_index: int) -> None:
    """Join the group as `rank`, build the rank's runner, follow rank 0's plans until stopped."""
    if spec.device == "cuda":
        torch.cuda.set_device(cuda_index)
    else:  # the ranks share the host's cores
        torch.set_num_threads(cpu_threads_per_rank(spec.size))
    group = TPGroup.join(spec, rank)
    _WorkerLoop(config, group, engine_id).run()


class _WorkerLoop:
    def __init__(self, config: EngineConfig, group: TPGroup, engine_id: str) -> None:
        from photon.worker.model_runner import ModelRunner

        self.group = group
        self.runner = ModelRunner(config, on_fault=self._on_fault, tp=group)
        self.decoder = msgspec.msgpack.Decoder(StepPlan)
        self.encoder = msgspec.msgpack.Encoder()
        self.last: dict[int, Any] = {}  # slot index -> the last step sampled in it
        kvt = config.kv_transfer_config
        self.connector: KVConnectorBase | None = None
        if kvt is not None:  # this rank's shard of the instance's KV transfers
            self.connector = create_connector(kvt, KVConnectorRole.WORKER, engine_id,
                                              config.cache.block_size, group.rank, group.size)
            self.runner.attach_kv_connector(self.connector)

    def _on_fault(self, req_index: int, error: str) -> None:
        """Rank 0 fails the request (its row runs inert here too, as on rank 0)."""

    def run(self) -> None:
        try:
            while True:
                data = self.group.broadcast_bytes(None, wait_s=_IDLE_WAIT_S)
                kind = data[:1]
                if kind == _STOP:
                    return
                if kind == _AUDIT:
                    self.group.max_int(self.runner.table.num_live)
                    c = self.connector
                    self.group.max_int(int(c is not None and c.has_pending()))
                elif kind == _KV:
                    report = take_report(self.connector) if self.connector is not None \
                        else KVTransferReport()
                    self.group.all_gather_bytes(self.encoder.encode(report))
                elif kind == _HANDSHAKE:
                    c = self.connector
                    metadata = c.get_handshake_metadata() if c is not None else None
                    self.group.all_gather_bytes(json.dumps(metadata).encode())
                else:
                    self._step(self.decoder.decode(data[1:]))
        finally:
            if self.connector is not None:  # stop its transfers, remove its unfinished files
                self.connector.close()

    @torch.inference_mode()
    def _step(self, plan: StepPlan) -> None:
        if not plan.empty:  # its slot's last step is done before the slot is staged again
            last = self.last.pop(plan.step % 2, None)
            if last is not None:
                self.runner.sync(last)
        prepared = self.runner.prepare(plan)
        if prepared is None:
            return
        handle = self.runner.launch(prepared)
        self.runner.sample(handle)
        self.last[plan.step % 2] = handle
