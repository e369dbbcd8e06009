"""SharedMemoryConnector: two instances on one machine (and the CPU tests).

Producer (kv_producer / kv_both): a request sent with `do_remote_decode` keeps its blocks when it
finishes; the next step's metadata has the runner gather them layer by layer (save_kv_layer) and a
transfer thread write them to a shared-memory file (wait_for_save only issues it). The blocks are
freed once the decode instance took the file (it removes it) or the lease (timeout_s) runs out.

Consumer (kv_consumer / kv_both): a request sent with `do_remote_prefill` gets its blocks, then a
transfer thread waits for the file (bounded by timeout_s and the producer's liveness) and copies
the blocks the local prefix cache did not already hold into them. Nothing waits in the engine
loop: get_finished polls the threads.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from photon.engine.request import RequestStatus
from photon.kv_transfer import segment
from photon.kv_transfer.base import KVConnectorBase, KVConnectorRole
from photon.kv_transfer.metadata import KVConnectorMetadata, KVTransferStats, LoadSpec, SaveSpec
from photon.kv_transfer.params import KVTransferParams

if TYPE_CHECKING:
    from photon.engine.request import Request
    from photon.kv_transfer.config import KVTransferConfig


@dataclass
class _Send:
    path: str
    future: Future[int]
    lease_start: float | None = None


@dataclass
class _Load:
    block_ids: list[int]
    future: Future[int]


@dataclass
class _Gathered:
    spec: SaveSpec
    layers: list[torch.Tensor] = field(default_factory=list)


class SharedMemoryConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, engine_id: str,
                 block_size: int) -> None:
        super().__init__(config, role, engine_id, block_size)
        self.extra = config.extra
        self._loads_planned: list[LoadSpec] = []
        self._saves_planned: list[SaveSpec] = []
        self._cancels_planned: list[int] = []
        # worker side
        self._dir = segment.segment_dir()
        self._caches: list[torch.Tensor] = []
        self._pool: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._progress = threading.Event()  # set by a transfer thread when it ends
        self._sends: dict[int, _Send] = {}
        self._loads: dict[int, _Load] = {}
        self._gathered: list[_Gathered] = []
        self._load_errors: set[int] = set()
        self._cancelled: set[int] = set()  # keys of loads to stop (read by transfer threads)
        self._lock = threading.Lock()  # guards _stats (transfer threads add to it)
        self._stats = KVTransferStats(role=config.kv_role)

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt's tokens past the local hit, but the last (recomputed here for its
        logits), when the request names a prefill instance's transfer."""
        params: KVTransferParams | None = request.kv_transfer_params
        if not self.config.is_consumer or params is None or not params.do_remote_prefill:
            return 0, False
        return max(request.num_prompt_tokens - 1 - num_computed_tokens, 0), True

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        params, bs = request.kv_transfer_params, self.block_size
        first = request.num_computed_tokens // bs  # a prefix-cache hit is whole blocks
        end = -(-(request.num_computed_tokens + num_external_tokens) // bs)
        self._loads_planned.append(LoadSpec(request.key, params.remote_engine_id,
                                            params.remote_request_id, first,
                                            list(block_ids[first:end])))

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
            # never loaded: release the producer's transfer (an empty load removes its file)
            self._loads_planned.append(LoadSpec(request.key, params.remote_engine_id,
                                                params.remote_request_id, 0, []))
            return False, None
        if params.do_remote_prefill and request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            self._cancels_planned.append(request.key)  # aborted while loading: stop waiting
            return False, None
        if not (self.config.is_producer and params.do_remote_decode and block_ids):
            return False, None
        transfer_id = str(request.key)
        self._saves_planned.append(SaveSpec(request.key, transfer_id, list(block_ids)))
        out = KVTransferParams(do_remote_prefill=True, remote_engine_id=self.engine_id,
                               remote_block_ids=list(block_ids), remote_host="localhost",
                               remote_request_id=transfer_id)
        return True, out.to_dict()

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._caches = kv_caches
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="photon-kv")

    def _path(self, engine_id: str, transfer_id: str) -> str:
        return segment.segment_path(self._dir, self.extra.rendezvous, engine_id, transfer_id)

    def start_load_kv(self) -> None:
        meta = self._metadata
        if meta is None:
            return
        self._cancelled.update(meta.cancels)
        for spec in meta.loads:
            fut = self._pool.submit(self._load, spec, time.monotonic() + self.extra.timeout_s)
            self._loads[spec.key] = _Load(spec.block_ids, fut)

    def _load(self, spec: LoadSpec, deadline: float) -> int:
        path = self._path(spec.remote_engine_id, spec.remote_request_id)
        try:
            if not spec.block_ids:
                return 0
            t0 = time.monotonic()
            segment.wait_for_segment(path, spec.remote_engine_id, deadline,
                                     lambda: self._stop.is_set() or spec.key in self._cancelled)
            nbytes = segment.read_blocks(path, self._caches, spec.first_block, spec.block_ids)
            if self._caches[0].is_cuda:
                torch.cuda.current_stream(self._caches[0].device).synchronize()
            self._count(bytes_received=nbytes, receive_seconds=time.monotonic() - t0,
                        num_received=1)
            return nbytes
        finally:
            segment.remove(path)  # the ack: the producer frees its blocks
            self._progress.set()

    def save_kv_layer(self, layer: int) -> None:
        """Gather this layer's blocks of the step's saves into host memory (on CUDA an async
        copy into pinned memory, fenced by wait_for_save's event)."""
        meta = self._metadata
        if meta is None or not meta.saves:
            return
        if layer == 0:
            self._gathered = [_Gathered(s) for s in meta.saves]
        cache = self._caches[layer]
        for g in self._gathered:
            ids = torch.tensor(g.spec.block_ids, dtype=torch.long, device=cache.device)
            blocks = cache[:, ids].transpose(0, 1)
            if cache.is_cuda:
                host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
                blocks = host.copy_(blocks, non_blocking=True)
            else:
                blocks = blocks.contiguous()
            g.layers.append(blocks)

    def wait_for_save(self) -> None:
        """Issue the gathered saves to the transfer thread (no wait here: get_finished polls)."""
        event = None
        if self._gathered and self._caches[0].is_cuda:
            event = torch.cuda.Event()
            event.record()
        for g in self._gathered:
            path = self._path(self.engine_id, g.spec.transfer_id)
            self._sends[g.spec.key] = _Send(path, self._pool.submit(self._save, path, g, event))
        self._gathered = []

    def _save(self, path: str, g: _Gathered, event: torch.cuda.Event | None) -> int:
        try:
            if event is not None:
                event.synchronize()
            if self.extra.inject_fault == "drop":
                return 0
            t0 = time.monotonic()
            nbytes = segment.write_segment(path, g.layers,
                                           publish=self.extra.inject_fault != "delay")
            self._count(bytes_sent=nbytes, send_seconds=time.monotonic() - t0, num_sent=1)
            return nbytes
        finally:
            self._progress.set()

    def get_finished(self) -> tuple[set[int], set[int]]:
        sending = {key for key, send in self._sends.items() if self._send_done(send)}
        for key in sending:
            del self._sends[key]
        recving = {key for key, load in self._loads.items() if load.future.done()}
        for key in recving:
            load = self._loads.pop(key)
            self._cancelled.discard(key)
            if load.future.exception() is not None:
                self._load_errors.update(load.block_ids)
                self._count(num_load_failures=1)
        return sending, recving

    def _send_done(self, send: _Send) -> bool:
        """Taken by the consumer, failed, dropped, or its lease ran out (then removed)."""
        if not send.future.done():
            return False
        if send.future.exception() is not None or self.extra.inject_fault == "drop":
            segment.remove(send.path + ".tmp")
            return True
        now = time.monotonic()
        if send.lease_start is None:
            send.lease_start = now
        published = self.extra.inject_fault != "delay"
        if not os.path.exists(send.path if published else send.path + ".tmp"):
            return True  # the consumer removed it: acknowledged
        if now - send.lease_start > self.extra.timeout_s:
            segment.remove(send.path)
            segment.remove(send.path + ".tmp")
            self._count(num_expired_leases=1)
            return True
        return False

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def has_pending(self) -> bool:
        return bool(self._sends or self._loads)

    def wait_for_progress(self, timeout: float) -> None:
        self._progress.wait(timeout)
        self._progress.clear()

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def stats(self) -> KVTransferStats:
        with self._lock:
            return self._stats.copy()

    def close(self) -> None:
        """Stop waiting loads, remove this instance's unfinished transfers."""
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for send in self._sends.values():
            segment.remove(send.path)
            segment.remove(send.path + ".tmp")
        self._sends.clear()
