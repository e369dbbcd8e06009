"""SharedMemoryConnector: two instances on one machine (and the CPU tests).

Producer (kv_producer / kv_both): a request sent with `do_remote_decode` keeps its blocks when it
finishes; the next step's metadata has the runner gather them layer by layer (save_kv_layer) and a
transfer thread write them to a shared-memory file (wait_for_save only issues it). The blocks are
freed once the decode instance took the file (it removes it) or the lease (timeout_s) runs out.

Consumer (kv_consumer / kv_both): a request sent with `do_remote_prefill` gets its blocks, then a
transfer thread waits for the file (bounded by timeout_s and the producer's liveness) and copies
the blocks the local prefix cache did not already hold into them. Nothing waits in the engine
loop: get_finished polls the threads.

Tensor parallelism: every rank's worker side saves and loads its own KV shard, in a file of its
own (segment.segment_path's rank); the engine learns a transfer finished once every rank did.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from photon.kv_transfer import segment
from photon.kv_transfer.planner import PlannedConnector

if TYPE_CHECKING:
    from photon.kv_transfer.base import KVConnectorRole
    from photon.kv_transfer.config import KVTransferConfig
    from photon.kv_transfer.metadata import LoadSpec, SaveSpec


@dataclass
class _Send:
    path: str
    future: Future[int] | None = None  # set at once, before any get_finished
    lease_start: float = 0.0  # set by the transfer thread before the future is done


@dataclass
class _Gathered:
    spec: SaveSpec
    layers: list[torch.Tensor] = field(default_factory=list)


class SharedMemoryConnector(PlannedConnector):
    name = "SharedMemoryConnector"

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, engine_id: str,
                 block_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, role, engine_id, block_size, tp_rank, tp_size)
        # worker side
        self._dir = segment.segment_dir()
        self._caches: list[torch.Tensor] = []
        self._pool: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._sends: dict[int, _Send] = {}
        self._gathered: list[_Gathered] = []

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._caches = kv_caches
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="photon-kv")

    def _path(self, engine_id: str, transfer_id: str) -> str:
        return segment.segment_path(self._dir, self.extra.rendezvous, engine_id, transfer_id,
                                    self.tp_rank)

    def submit_load(self, spec: LoadSpec, deadline: float) -> Future[int]:
        return self._pool.submit(self._load, spec, deadline)

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
            self.count(bytes_received=nbytes, receive_seconds=time.monotonic() - t0,
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
            send = _Send(path)
            send.future = self._pool.submit(self._save, send, g, event)
            self._sends[g.spec.key] = send
        self._gathered = []

    def _save(self, send: _Send, g: _Gathered, event: torch.cuda.Event | None) -> int:
        path = send.path
        try:
            if event is not None:
                event.synchronize()
            if self.extra.inject_fault == "drop":
                return 0
            t0 = time.monotonic()
            nbytes = segment.write_segment(path, g.layers,
                                           publish=self.extra.inject_fault != "delay")
            self.count(bytes_sent=nbytes, send_seconds=time.monotonic() - t0, num_sent=1)
            return nbytes
        finally:
            # The lease runs from here on every rank alike, however late get_finished looks.
            send.lease_start = time.monotonic()
            self._progress.set()

    def get_finished(self) -> tuple[set[int], set[int]]:
        sending = {key for key, send in self._sends.items() if self._send_done(send)}
        for key in sending:
            del self._sends[key]
        return sending, self.finished_loads()

    def _send_done(self, send: _Send) -> bool:
        """Taken by the consumer, failed, dropped, or its lease ran out (then removed)."""
        if not send.future.done():
            return False
        if send.future.exception() is not None or self.extra.inject_fault == "drop":
            segment.remove(send.path + ".tmp")
            return True
        now = time.monotonic()
        published = self.extra.inject_fault != "delay"
        if not os.path.exists(send.path if published else send.path + ".tmp"):
            return True  # the consumer removed it: acknowledged
        if now - send.lease_start > self.extra.timeout_s:
            segment.remove(send.path)
            segment.remove(send.path + ".tmp")
            self.count(num_expired_leases=1)
            return True
        return False

    def has_pending(self) -> bool:
        return bool(self._sends or self._loads)

    def close(self) -> None:
        """Stop waiting loads, remove this instance's unfinished transfers."""
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for send in self._sends.values():
            segment.remove(send.path)
            segment.remove(send.path + ".tmp")
        self._sends.clear()
