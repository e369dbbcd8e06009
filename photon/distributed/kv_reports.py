"""KV transfers under tensor parallelism: rank 0's view of every rank's connector.

Every rank's worker side saves and loads its own KV shard; the scheduler (on rank 0) may free a
send's blocks, or run a loaded request, only once EVERY rank finished that transfer, and a load
that failed on any rank fails the request as a whole (never a partial KV). `RankedConnector`
wraps rank 0's own connector: it counts, per transfer, the ranks that reported it finished and
hands the scheduler only the transfers all ranks finished.

The other ranks report only when asked (`take_report`, all-gathered over the group's CPU
group), and rank 0 asks only while a transfer it finished itself still waits for another rank:
a step with no transfer finishing costs no collective. The ask is a collective on the group the
step plans use, so it is made only where a plan broadcast could be (collect_reports: before a
plan is broadcast, or with no step in flight), never between a plan's broadcast and its launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from photon.kv_transfer.base import KVConnectorBase
from photon.kv_transfer.metadata import KVConnectorMetadata, KVTransferReport, KVTransferStats

if TYPE_CHECKING:
    import torch


def take_report(connector: KVConnectorBase) -> KVTransferReport:
    """What `connector` finished since it was last asked (its get_finished and load errors)."""
    sending, recving = connector.get_finished()
    errors = connector.get_block_ids_with_load_errors()
    return KVTransferReport(sorted(sending), sorted(recving), sorted(errors), connector.stats())


class RankedConnector(KVConnectorBase):
    """Rank 0's worker side: its own connector (`local`, which the runner drives as usual) and
    the reports of ranks 1.. (`poll`: one report per rank, in rank order)."""

    def __init__(self, local: KVConnectorBase,
                 poll: Callable[[], list[KVTransferReport]]) -> None:
        super().__init__(local.config, local.role, local.engine_id, local.block_size,
                         local.tp_rank, local.tp_size)
        self.local = local
        self._poll = poll
        self._load_blocks: dict[int, set[int]] = {}  # key -> its load's blocks, until all done
        self._sent: dict[int, set[int]] = {}  # key -> the ranks that finished its send
        self._recvd: dict[int, set[int]] = {}  # key -> the ranks that finished its load
        self._failed: set[int] = set()  # keys whose load failed on some rank
        self._errors: set[int] = set()  # blocks of failed loads every rank finished
        self._worker_stats: dict[int, KVTransferStats] = {}
        self._num_received = 0
        self._num_failed = 0

    # ---- the runner's calls: rank 0's own shard -------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.local.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> dict[str, Any] | None:
        return self.local.get_handshake_metadata()

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        for spec in metadata.loads:
            self._load_blocks[spec.key] = set(spec.block_ids)
        self.local.bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        self.local.clear_connector_metadata()

    def start_load_kv(self) -> None:
        self.local.start_load_kv()

    def wait_for_layer_load(self, layer: int) -> None:
        self.local.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int) -> None:
        self.local.save_kv_layer(layer)

    def wait_for_save(self) -> None:
        self.local.wait_for_save()

    def wait_for_progress(self, timeout: float) -> None:
        self.local.wait_for_progress(timeout)

    def close(self) -> None:
        self.local.close()

    # ---- the engine's calls: every rank ---------------------------------------------------
    def collect_reports(self) -> None:
        """Ask the other ranks what they finished, if a transfer rank 0 finished waits for
        them (call only where a plan broadcast could be: see the module docstring)."""
        self._take(0, take_report(self.local))
        if self._waiting_on_workers():
            for rank, report in enumerate(self._poll(), start=1):
                self._take(rank, report)

    def get_finished(self) -> tuple[set[int], set[int]]:
        """The transfers every rank finished (the other ranks' as last collected)."""
        self._take(0, take_report(self.local))
        return _complete(self._sent, self.tp_size), self._loads_complete()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def has_pending(self) -> bool:
        return self.local.has_pending() or any(
            len(ranks) < self.tp_size for ranks in (*self._sent.values(), *self._recvd.values()))

    def stats(self) -> KVTransferStats:
        """Rank 0's counters, with the bytes of every rank (as of its last report) and the
        loads counted once per request, failed if they failed on any rank."""
        total = self.local.stats()
        for worker in self._worker_stats.values():
            total.bytes_sent += worker.bytes_sent
            total.bytes_received += worker.bytes_received
        total.num_received, total.num_load_failures = self._num_received, self._num_failed
        return total

    # ---- bookkeeping ----------------------------------------------------------------------
    def _take(self, rank: int, report: KVTransferReport) -> None:
        for key in report.sending:
            self._sent.setdefault(key, set()).add(rank)
        errors = set(report.error_blocks)
        for key in report.recving:
            self._recvd.setdefault(key, set()).add(rank)
            if not errors.isdisjoint(self._load_blocks.get(key, ())):
                self._failed.add(key)
        if rank:
            self._worker_stats[rank] = report.stats

    def _waiting_on_workers(self) -> bool:
        return any(0 in ranks and len(ranks) < self.tp_size
                   for ranks in (*self._sent.values(), *self._recvd.values()))

    def _loads_complete(self) -> set[int]:
        done = _complete(self._recvd, self.tp_size)
        for key in done:
            blocks = self._load_blocks.pop(key, set())
            if key in self._failed:
                self._failed.discard(key)
                self._errors |= blocks  # the whole request's blocks: recomputed or failed
                self._num_failed += 1
            elif blocks:
                self._num_received += 1
        return done


def _complete(finished: dict[int, set[int]], size: int) -> set[int]:
    """The keys every rank finished, taken out of `finished`."""
    done = {key for key, ranks in finished.items() if len(ranks) == size}
    for key in done:
        del finished[key]
    return done
