"""NcclConnector: a prefill instance's KV cache to a decode instance over torch.distributed
point-to-point send/recv (NCCL between CUDA devices, gloo on CPU: the same code).

Producer (kv_producer / kv_both): at start it hosts a rendezvous store on kv_ip:kv_port (from
kv_connector_extra_config; port 0: a free port) and tells decode instances the address in each
transfer's kv_transfer_params (remote_host, remote_port). A decode instance connects only to the
hosts kv_connector_extra_config.allowed_remote_hosts allows (checked at the request's edge and
again before connecting). A request sent with `do_remote_decode`
keeps its blocks when it finishes; the next step offers them (on CUDA behind an event of the
step that wrote them). A decode instance's ask is served by that pair's transfer thread (on CUDA
on a stream of its own); the blocks are freed once sent, or when the lease (timeout_s) runs out
with nobody asking. The KV goes after the prefill step, not during its forward pass.

Consumer (kv_consumer / kv_both): a request sent with `do_remote_prefill` gets its blocks, then
the transfer thread of its prefill instance's pair asks for the blocks the local prefix cache
lacks and receives them into its own (photon/kv_transfer/nccl_link.py has the protocol). Every
wait is bounded by timeout_s; a dead prefill instance fails the load at once. A failed load is
recomputed or fails the request (on_failure); nothing waits in the engine loop.

Tensor parallelism: every rank r of the prefill instance hosts a rendezvous of its own (kv_port
+ r, or a free port each) and serves its KV shard; kv_transfer_params carry every rank's port
(remote_ports, gathered at start through the handshake metadata) and rank r of the decode
instance pairs with rank r only. The engine learns a transfer finished once every rank did
(RankedConnector); a load failed on any rank recomputes or fails the whole request.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from photon.kv_transfer.addressed import AddressedConnector
from photon.kv_transfer.nccl_link import Ask, ConsumerLink, Offer, ProducerEndpoint

if TYPE_CHECKING:
    from photon.kv_transfer.base import KVConnectorRole
    from photon.kv_transfer.config import KVTransferConfig
    from photon.kv_transfer.metadata import LoadSpec


class NcclConnector(AddressedConnector):
    name = "NcclConnector"

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, engine_id: str,
                 block_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, role, engine_id, block_size, tp_rank, tp_size)
        self._caches: list[torch.Tensor] = []
        self._endpoint: ProducerEndpoint | None = None
        self._links: dict[tuple[str, int], tuple[ConsumerLink, ThreadPoolExecutor]] = {}
        self._stop = threading.Event()

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._caches = kv_caches
        if self.config.is_producer:
            self._endpoint = ProducerEndpoint(
                self.extra.kv_ip, self.listen_port(), kv_caches, self.extra.timeout_s,
                self._on_sent, self._progress, serve=self.extra.inject_fault != "delay", rank=self.tp_rank)

    def get_handshake_metadata(self) -> dict[str, Any] | None:
        if self._endpoint is None:
            return None
        return self.handshake_metadata(self._endpoint.port)

    def _on_sent(self, nbytes: int, seconds: float) -> None:
        self.count(bytes_sent=nbytes, send_seconds=seconds, num_sent=1)

    def submit_load(self, spec: LoadSpec, deadline: float) -> Future[int]:
        failed = self.refused_load(spec)  # checked again here, before any connection
        if failed is not None:
            return failed
        link, pool = self._link(spec)
        return pool.submit(self._load, link, spec, deadline)

    def _link(self, spec: LoadSpec) -> tuple[ConsumerLink, ThreadPoolExecutor]:
        """The pair with the spec's prefill instance's rank (this rank's) and its transfer
        thread (one per instance: a pair carries one transfer at a time)."""
        address = (spec.remote_host or "", self.remote_port(spec) or 0)
        if address not in self._links:
            link = ConsumerLink(*address, self._caches, self._stop)
            self._links[address] = (link, ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="photon-kv-load"))
        return self._links[address]

    def _load(self, link: ConsumerLink, spec: LoadSpec, deadline: float) -> int:
        try:
            if self.address_error(spec):
                raise ValueError(self.address_error(spec))
            t0 = time.monotonic()
            ask = Ask(spec.remote_request_id, spec.first_block, len(spec.block_ids),
                      self.tp_rank)
            nbytes = link.load(ask, spec.block_ids, deadline,
                               lambda: spec.key in self._cancelled)
            if spec.block_ids:
                self.count(bytes_received=nbytes, receive_seconds=time.monotonic() - t0,
                           num_received=1)
            return nbytes
        finally:
            self._progress.set()

    def wait_for_save(self) -> None:
        """Offer the step's saves (no copy: the pair threads read the held blocks)."""
        meta, ep = self._metadata, self._endpoint
        if meta is None or not meta.saves or ep is None:
            return
        event = None
        if self._caches[0].is_cuda:
            event = torch.cuda.Event()
            event.record()
        now = time.monotonic()
        for spec in meta.saves:
            if self.extra.inject_fault == "drop":
                ep.release(spec.key)  # never offered: its blocks are freed at once
            else:
                ep.offer(spec.transfer_id, Offer(spec.key, spec.block_ids, now, event))

    def get_finished(self) -> tuple[set[int], set[int]]:
        sending: set[int] = set()
        if self._endpoint is not None:
            expired = self._endpoint.expire(time.monotonic())
            if expired:
                self.count(num_expired_leases=expired)
            sending = self._endpoint.finished()
        return sending, self.finished_loads()

    def has_pending(self) -> bool:
        return bool(self._loads) or (self._endpoint is not None and self._endpoint.pending())

    def close(self) -> None:
        """Stop the transfer threads (each wait ends within its poll) and the rendezvous."""
        self._stop.set()
        for link, pool in self._links.values():
            pool.shutdown(wait=True)
            link.drop()
        self._links.clear()
        if self._endpoint is not None:
            self._endpoint.close()

