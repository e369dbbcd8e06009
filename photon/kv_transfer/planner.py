"""`PlannedConnector`: what the connectors that move a finished prefill's blocks share.

The scheduler side plans, per request, the load of the prompt's blocks the decode side's prefix
cache lacks (a `LoadSpec`), the save of a finished prefill's blocks (a `SaveSpec`) and the stop of
an aborted load; the worker side's subclasses carry them out on transfer threads. Also shared:
the loads' futures (a failed one reports its blocks in get_block_ids_with_load_errors), the
progress event the engine waits on when idle, and the transfer counters.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from photon.engine.request import RequestStatus
from photon.kv_transfer.base import KVConnectorBase, KVConnectorRole
from photon.kv_transfer.metadata import KVConnectorMetadata, KVTransferStats, LoadSpec, SaveSpec
from photon.kv_transfer.params import KVTransferParams

if TYPE_CHECKING:
    from photon.engine.request import Request
    from photon.kv_transfer.config import KVTransferConfig


@dataclass
class Load:
    block_ids: list[int]
    future: Future[int]


class PlannedConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, engine_id: str,
                 block_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, role, engine_id, block_size, tp_rank, tp_size)
        self.extra = config.extra
        self._loads_planned: list[LoadSpec] = []
        self._saves_planned: list[SaveSpec] = []
        self._cancels_planned: list[int] = []
        # worker side
        self._progress = threading.Event()  # set by a transfer thread when it ends
        self._loads: dict[int, Load] = {}
        self._load_errors: set[int] = set()
        self._cancelled: set[int] = set()  # keys of loads to stop (read by transfer threads)
        self._lock = threading.Lock()  # guards _stats (transfer threads add to it)
        self._stats = KVTransferStats(role=config.kv_role)

    # ---- scheduler side -----------------------------------------------------------------------
    def remote_params(self, transfer_id: str, block_ids: list[int]) -> KVTransferParams:
        """What a decode instance is told of a saved transfer (where to find it)."""
        return KVTransferParams(do_remote_prefill=True, remote_engine_id=self.engine_id,
                                remote_block_ids=list(block_ids), remote_host="localhost",
                                remote_request_id=transfer_id, tp_size=self.tp_size)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt's tokens past the local hit, but the last (recomputed here for its
        logits), when the request names a prefill instance's transfer."""
        params: KVTransferParams | None = request.kv_transfer_params
        if not self.config.is_consumer or params is None or not params.do_remote_prefill:
            return 0, False
        return max(request.num_prompt_tokens - 1 - num_computed_tokens, 0), True

    def _plan_load(self, request: Request, first: int, block_ids: list[int]) -> None:
        params = request.kv_transfer_params
        remote = list(params.remote_block_ids[first:first + len(block_ids)])
        self._loads_planned.append(LoadSpec(request.key, params.remote_engine_id,
                                            params.remote_request_id, first, block_ids,
                                            params.remote_host, params.remote_port,
                                            list(params.remote_ports), remote))

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        bs = self.block_size
        first = request.num_computed_tokens // bs  # a prefix-cache hit is whole blocks
        end = -(-(request.num_computed_tokens + num_external_tokens) // bs)
        self._plan_load(request, first, list(block_ids[first:end]))

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(self._loads_planned, self._saves_planned,
                                   self._cancels_planned)
        self._loads_planned, self._saves_planned, self._cancels_planned = [], [], []
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if params is None:
            return False, None
        if params.do_remote_prefill and not request.kv_load_done:
            self._plan_load(request, 0, [])  # never loaded: an empty load releases the transfer
            return False, None
        if params.do_remote_prefill and request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            self._cancels_planned.append(request.key)  # aborted while loading: stop waiting
            return False, None
        if not (self.config.is_producer and params.do_remote_decode and block_ids):
            return False, None
        transfer_id = str(request.key)
        self._saves_planned.append(SaveSpec(request.key, transfer_id, list(block_ids)))
        return True, self.remote_params(transfer_id, block_ids).to_dict()

    # ---- worker side --------------------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Note the step's aborted loads and issue its loads on transfer threads."""
        meta = self._metadata
        if meta is None:
            return
        self._cancelled.update(meta.cancels)
        for spec in meta.loads:
            fut = self.submit_load(spec, time.monotonic() + self.extra.timeout_s)
            self._loads[spec.key] = Load(spec.block_ids, fut)

    def submit_load(self, spec: LoadSpec, deadline: float) -> Future[int]:
        """Run the load on a transfer thread (done by `deadline`, time.monotonic()); its
        future gives the bytes loaded."""
        raise NotImplementedError

    def finished_loads(self) -> set[int]:
        """Keys of the loads that ended; a failed one's blocks go to the load errors."""
        recving = {key for key, load in self._loads.items() if load.future.done()}
        for key in recving:
            load = self._loads.pop(key)
            self._cancelled.discard(key)
            if load.future.exception() is not None:
                self._load_errors.update(load.block_ids)
                self.count(num_load_failures=1)
        return recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_progress(self, timeout: float) -> None:
        self._progress.wait(timeout)
        self._progress.clear()

    def count(self, **deltas: float) -> None:
        """Add to the counters (any thread)."""
        with self._lock:
            for name, value in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def stats(self) -> KVTransferStats:
        with self._lock:
            return self._stats.copy()
