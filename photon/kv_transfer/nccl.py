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

import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from photon.config import ConfigError
from photon.kv_transfer.config import FLAG
from photon.kv_transfer.nccl_link import Ask, ConsumerLink, Offer, ProducerEndpoint
from photon.kv_transfer.params import KVTransferParams
from photon.kv_transfer.planner import PlannedConnector

if TYPE_CHECKING:
    from photon.kv_transfer.base import KVConnectorRole
    from photon.kv_transfer.config import KVTransferConfig
    from photon.kv_transfer.metadata import LoadSpec


class NcclConnector(PlannedConnector):
    name = "NcclConnector"
    connects_to_remote_host = True

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, engine_id: str,
                 block_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, role, engine_id, block_size, tp_rank, tp_size)
        # scheduler side: the producer's host and each rank's rendezvous port
        self._host: str | None = None
        self._ports: list[int] = []
        # worker side
        self._caches: list[torch.Tensor] = []
        self._endpoint: ProducerEndpoint | None = None
        self._links: dict[tuple[str, int], tuple[ConsumerLink, ThreadPoolExecutor]] = {}
        self._stop = threading.Event()

    # ---- scheduler side -----------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, dict[str, Any]]) -> None:
        ranks = [metadata.get(rank) for rank in range(self.tp_size)]
        if not all(ranks):
            return  # not a producer
        hosts = {m["host"] for m in ranks}
        if len(hosts) > 1:  # kv_transfer_params name one host for every rank
            raise ConfigError(f"{FLAG}: the NcclConnector needs every tensor-parallel rank of "
                              f"a prefill instance on one host; its ranks advertise "
                              f"{sorted(hosts)}")
        self._host, self._ports = hosts.pop(), [m["port"] for m in ranks]

    def remote_params(self, transfer_id: str, block_ids: list[int]) -> KVTransferParams:
        return KVTransferParams(do_remote_prefill=True, remote_engine_id=self.engine_id,
                                remote_block_ids=list(block_ids), remote_host=self._host,
                                remote_port=self._ports[0] if self._ports else None,
                                remote_request_id=transfer_id, tp_size=self.tp_size,
                                remote_ports=list(self._ports))

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._caches = kv_caches
        if self.config.is_producer:
            port = self.extra.kv_port + self.tp_rank if self.extra.kv_port else 0
            self._endpoint = ProducerEndpoint(
                self.extra.kv_ip, port, kv_caches, self.extra.timeout_s, self._on_sent,
                self._progress, serve=self.extra.inject_fault != "delay", rank=self.tp_rank)

    def get_handshake_metadata(self) -> dict[str, Any] | None:
        if self._endpoint is None:
            return None
        return {"host": _advertised(self.extra.kv_ip), "port": self._endpoint.port}

    def _on_sent(self, nbytes: int, seconds: float) -> None:
        self.count(bytes_sent=nbytes, send_seconds=seconds, num_sent=1)

    def submit_load(self, spec: LoadSpec, deadline: float) -> Future[int]:
        refused = self.extra.host_refusal(spec.remote_host) if spec.remote_host else None
        if refused is not None:  # checked again here, before any connection: the load fails
            failed: Future[int] = Future()
            failed.set_exception(PermissionError(refused))
            self._progress.set()
            return failed
        link, pool = self._link(spec)
        return pool.submit(self._load, link, spec, deadline)

    def _link(self, spec: LoadSpec) -> tuple[ConsumerLink, ThreadPoolExecutor]:
        """The pair with the spec's prefill instance's rank (this rank's) and its transfer
        thread (one per instance: a pair carries one transfer at a time)."""
        address = (spec.remote_host or "", self._remote_port(spec) or 0)
        if address not in self._links:
            link = ConsumerLink(*address, self._caches, self._stop)
            self._links[address] = (link, ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="photon-kv-load"))
        return self._links[address]

    def _load(self, link: ConsumerLink, spec: LoadSpec, deadline: float) -> int:
        try:
            if not spec.remote_host or not self._remote_port(spec):
                raise ValueError(f"kv_transfer_params name no remote_host and remote_port of "
                                 f"the prefill instance's rank {self.tp_rank}")
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

    def _remote_port(self, spec: LoadSpec) -> int | None:
        """This rank's rendezvous on the prefill instance (rank 0's: remote_port)."""
        if self.tp_rank < len(spec.remote_ports):
            return spec.remote_ports[self.tp_rank]
        return spec.remote_port if self.tp_rank == 0 else None

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


def _advertised(host: str) -> str:
    """The address decode instances reach: the host's name when listening on every address."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host
