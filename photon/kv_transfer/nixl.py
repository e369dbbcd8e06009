"""NixlConnector: a decode instance reads a prefill instance's KV cache with NIXL (NVIDIA's
transfer library; UCX moves host memory, and GPU memory where UCX has its CUDA transports).
Pull-based, as vLLM's connector of the same name.

Producer (kv_producer / kv_both): at start every rank registers its KV cache tensors with a NIXL
agent of its own and serves a handshake (photon/kv_transfer/nixl_handshake.py: its agent's
metadata and its KV layout) on kv_ip:kv_port + rank (port 0: a free one). A request sent with
`do_remote_decode` keeps its blocks when it finishes; its kv_transfer_params name the instance
(remote_engine_id, remote_host, remote_port(s)) and its blocks (remote_block_ids). The blocks are
freed once the decode instance's notification (the transfer's id) arrives, or when the lease
(timeout_s) runs out.

Consumer (kv_consumer / kv_both): per request with remote KV it handshakes once with the prefill
rank it pairs with (cached), then posts one NIXL READ of the prompt's blocks its prefix cache
lacks (photon/kv_transfer/nixl_reads.py). A READ that fails, or is not done by timeout_s, fails
the load: recomputed or the request fails (on_failure).

Every NIXL call runs on the connector's transfer thread (the agent needs no locking), which
polls the READs in flight and the notifications every 2 ms while any pend and sleeps
otherwise: NIXL moves and notifies only while both agents are polled, and its own progress
thread would spin a core. The engine loop never calls NIXL nor waits on it: it hands loads and
offers over and reads what ended. Tensor parallelism: rank r pairs with rank r
(AddressedConnector); the engine counts a transfer finished once every rank did
(RankedConnector).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from photon.config import ConfigError
from photon.kv_transfer import nixl_handshake as hs
from photon.kv_transfer.addressed import AddressedConnector
from photon.kv_transfer.config import FLAG
from photon.kv_transfer.nixl_reads import Reads, parse_notification, read_of

if TYPE_CHECKING:
    import torch

    from photon.kv_transfer.base import KVConnectorRole
    from photon.kv_transfer.config import KVTransferConfig
    from photon.kv_transfer.metadata import LoadSpec

_POLL_S = 2e-3  # the transfer thread's poll interval while a READ or an offer pends


def _nixl() -> Any:
    """The nixl package's API (ConfigError naming the install when it is missing)."""
    try:
        from nixl import _api
    except ImportError as e:
        raise ConfigError(f"{FLAG}: kv_connector NixlConnector needs the nixl package, which "
                          f"is not installed ({e}); install it with: pip install nixl "
                          f"(or pip install 'photon-llm[nixl]')") from e
    return _api


@dataclass
class _Offer:
    key: int
    registered: float  # time.monotonic(): the lease's start


class NixlConnector(AddressedConnector):
    name = "NixlConnector"

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, engine_id: str,
                 block_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        self._api = _nixl()  # a missing package fails at start, naming the install
        super().__init__(config, role, engine_id, block_size, tp_rank, tp_size)
        self._agent: Any = None
        self._server: hs.HandshakeServer | None = None
        self._reads: Reads | None = None  # the transfer thread's
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  # work for the transfer thread
        self._stop = threading.Event()
        # handed over under _lock: loads and offers to the thread, ended sends back
        self._new_loads: list[tuple[LoadSpec, float, Future[int]]] = []
        self._new_offers: dict[str, _Offer] = {}
        self._sent: set[int] = set()
        self._num_offers = 0  # offered and not yet in _sent
        # the transfer thread's: offers waiting for a notification, notifications that came
        # before their offer
        self._offers: dict[str, _Offer] = {}
        self._early: dict[str, tuple[int, float]] = {}

    @classmethod
    def check_config(cls, config: KVTransferConfig, tensor_parallel_size: int) -> None:
        """The nixl package is installed (the error names the install)."""
        _nixl()

    # ---- worker side: the engine loop -----------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        name = f"photon-{self.engine_id}-rank{self.tp_rank}"
        api = self._api
        # no progress thread (it spins a core): the transfer thread's polls make the progress
        self._agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False,
                                                                 backends=["UCX"]))
        self._agent.register_memory(kv_caches)
        layout = hs.KVLayout.of(kv_caches, self.engine_id, name, self.tp_rank)
        if self.config.is_producer:
            answer = hs.Handshake(layout, self._agent.get_agent_metadata())
            self._server = hs.HandshakeServer(self.extra.kv_ip, self.listen_port(), answer)
        self._reads = Reads(self._agent, layout, self._cancelled, self._wake.set,
                            self._progress.set, self.count)
        self._thread = threading.Thread(target=self._run, name="photon-kv-nixl", daemon=True)
        self._thread.start()

    def get_handshake_metadata(self) -> dict[str, Any] | None:
        return None if self._server is None else self.handshake_metadata(self._server.port)

    def submit_load(self, spec: LoadSpec, deadline: float) -> Future[int]:
        failed = self.refused_load(spec)  # checked again here, before any connection
        if failed is not None:
            return failed
        future: Future[int] = Future()
        problem = self.address_error(spec)
        if problem is not None:
            future.set_exception(ValueError(problem))
            return future
        with self._lock:
            self._new_loads.append((spec, deadline, future))
        self._wake.set()
        return future

    def wait_for_save(self) -> None:
        """Offer the step's saves: nothing moves here, the decode instance reads the blocks."""
        meta = self._metadata
        if meta is None or not meta.saves or self._server is None:
            return
        now = time.monotonic()
        with self._lock:
            for spec in meta.saves:
                self._new_offers[spec.transfer_id] = _Offer(spec.key, now)
            self._num_offers += len(meta.saves)
        self._wake.set()

    def get_finished(self) -> tuple[set[int], set[int]]:
        with self._lock:
            sent, self._sent = self._sent, set()
            self._num_offers -= len(sent)
        return sent, self.finished_loads()

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._loads or self._new_loads or self._num_offers)

    def close(self) -> None:
        """Stop the transfer thread (it aborts the READs in flight) and the handshake."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30)
        if self._server is not None:
            self._server.close()

    # ---- the transfer thread --------------------------------------------------------------
    def _run(self) -> None:
        reads = self._reads
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._take_handed_over(reads)
                reads.advance()
                if self._server is not None:
                    self._take_notifications()
                    self._expire()
                busy = reads.pending() or self._offers
                self._wake.wait(_POLL_S if busy else None)
        finally:
            reads.close()

    def _take_handed_over(self, reads: Reads) -> None:
        with self._lock:
            loads, self._new_loads = self._new_loads, []
            offers, self._new_offers = self._new_offers, {}
        for spec, deadline, future in loads:
            reads.add(read_of(spec, self.remote_port(spec), deadline, future))
        for transfer_id, offer in offers.items():
            self._offers[transfer_id] = offer
            early = self._early.pop(transfer_id, None)
            if early is not None:  # read before the step offered it
                self._taken(transfer_id, early[0])

    def _take_notifications(self) -> None:
        now = time.monotonic()
        for messages in self._agent.get_new_notifs().values():
            for message in messages:
                parsed = parse_notification(message)
                if parsed is None:
                    continue
                if parsed[0] in self._offers:
                    self._taken(*parsed)
                else:
                    self._early[parsed[0]] = (parsed[1], now)

    def _taken(self, transfer_id: str, nbytes: int) -> None:
        key = self._offers.pop(transfer_id).key
        with self._lock:
            self._sent.add(key)
        if nbytes:
            self.count(bytes_sent=nbytes, num_sent=1)
        self._progress.set()

    def _expire(self) -> None:
        """End the leases nobody took in time (their blocks are freed)."""
        now, lease = time.monotonic(), self.extra.timeout_s
        old = [t for t, o in self._offers.items() if now - o.registered > lease]
        if old:
            with self._lock:
                self._sent.update(self._offers.pop(t).key for t in old)
            self.count(num_expired_leases=len(old))
            self._progress.set()
        for transfer_id in [t for t, (_, at) in self._early.items() if now - at > lease]:
            del self._early[transfer_id]
