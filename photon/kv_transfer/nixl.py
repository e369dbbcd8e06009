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
rank it pairs with (cached; a handshake thread does the network wait), then posts one NIXL READ
of the prompt's blocks its prefix cache lacks: per layer, for K and for V, one descriptor per run
of blocks consecutive on both sides, with the transfer's id as the notification. The engine loop
polls the READ (check_xfer_state) and never waits on it. A READ that fails, or is not done by
timeout_s, fails the load: recomputed or the request fails (on_failure). A request that loads
nothing (prefix-cache hit, or it ended first) sends the notification alone: the prefill instance
frees its blocks.

Every NIXL call runs on the engine loop's thread (the agent needs no locking, and runs no
progress thread: NIXL's spins a core); the handshake threads only read sockets. A READ completes
only while both instances' engine loops poll their agents, which they do at every step and every
2 ms while a transfer is pending. Tensor parallelism is refused: the other ranks' loops poll
their connectors only when rank 0 asks.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from photon.config import ConfigError
from photon.kv_transfer import nixl_handshake as hs
from photon.kv_transfer.addressed import AddressedConnector
from photon.kv_transfer.config import FLAG
from photon.kv_transfer.p2p import KVTransferError, KVTransferTimeout

if TYPE_CHECKING:
    import torch

    from photon.kv_transfer.base import KVConnectorRole
    from photon.kv_transfer.config import KVTransferConfig
    from photon.kv_transfer.metadata import LoadSpec

# The idle engine's longest wait while a READ is in flight or blocks are offered: NIXL moves
# and notifies only while both agents are polled (no progress thread: it would spin a core).
_POLL_S = 2e-3
_HANDSHAKE_TIMEOUT_S = 10.0  # bound on one handshake (and on the load's deadline)

Address = tuple[str, int]


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
class _Read:
    """One load: waiting for its handshake (handle None), then its READ in flight."""

    spec: LoadSpec
    address: Address
    deadline: float
    future: Future[int]
    handle: Any = None
    nbytes: int = 0
    started: float = 0.0


@dataclass
class _Offer:
    key: int
    registered: float  # time.monotonic(): the lease's start


def notification(transfer_id: str, nbytes: int) -> bytes:
    return f"{transfer_id}:{nbytes}".encode()


def parse_notification(message: bytes) -> tuple[str, int] | None:
    transfer_id, _, nbytes = message.decode(errors="replace").rpartition(":")
    return (transfer_id, int(nbytes)) if transfer_id and nbytes.isdigit() else None


class NixlConnector(AddressedConnector):
    name = "NixlConnector"

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, engine_id: str,
                 block_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.check_config(config, tp_size)
        self._api = _nixl()
        super().__init__(config, role, engine_id, block_size, tp_rank, tp_size)
        self._agent: Any = None
        self._layout: hs.KVLayout | None = None
        self._server: hs.HandshakeServer | None = None
        # consumer: handshakes in flight and the prefill ranks known (their agents added)
        self._pool: ThreadPoolExecutor | None = None
        self._handshakes: dict[Address, Future[hs.Handshake]] = {}
        self._remotes: dict[Address, hs.KVLayout] = {}
        self._reads: list[_Read] = []
        # producer: transfers waiting for their notification; notifications that came first
        self._offers: dict[str, _Offer] = {}
        self._early: dict[str, tuple[int, float]] = {}
        self._sent: set[int] = set()

    @classmethod
    def check_config(cls, config: KVTransferConfig, tensor_parallel_size: int) -> None:
        """The nixl package is installed (the error names the install); one rank only."""
        _nixl()
        if tensor_parallel_size > 1:
            raise ConfigError(f"{FLAG}: kv_connector NixlConnector runs with "
                              f"tensor_parallel_size 1 only (got {tensor_parallel_size}); use "
                              f"the NcclConnector or the SharedMemoryConnector with tensor "
                              f"parallelism")

    # ---- worker side: start ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        name = f"photon-{self.engine_id}-rank{self.tp_rank}"
        api = self._api
        # no progress thread (it spins a core): the engine loop's polls make the progress
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = api.nixl_agent(name, config)
        self._agent.register_memory(kv_caches)
        self._layout = hs.KVLayout.of(kv_caches, self.engine_id, name, self.tp_rank)
        if self.config.is_producer:
            answer = hs.Handshake(self._layout, self._agent.get_agent_metadata())
            self._server = hs.HandshakeServer(self.extra.kv_ip, self.listen_port(), answer)

    def get_handshake_metadata(self) -> dict[str, Any] | None:
        return None if self._server is None else self.handshake_metadata(self._server.port)

    # ---- worker side: loads (consumer) ----------------------------------------------------
    def submit_load(self, spec: LoadSpec, deadline: float) -> Future[int]:
        failed = self.refused_load(spec)  # checked again here, before any connection
        if failed is not None:
            return failed
        future: Future[int] = Future()
        problem = self.address_error(spec)
        if problem is not None:
            future.set_exception(ValueError(problem))
            return future
        address = (spec.remote_host, self.remote_port(spec))
        self._reads.append(_Read(spec, address, deadline, future))
        self._advance()
        return future

    def _advance(self) -> None:
        """Post the READs whose handshake is done, poll those in flight, end the late ones."""
        done = [a for a, f in self._handshakes.items() if f.done()]  # seen by every read below
        for read in list(self._reads):
            try:
                if read.handle is None:
                    self._try_post(read)
                if read.handle is not None:
                    self._poll(read)
                elif self._overdue(read):
                    raise KVTransferTimeout("the prefill instance's handshake did not come "
                                            "in time")
            except Exception as e:  # noqa: BLE001 - the load fails, the engine goes on
                self._finish(read, error=e)
        for address in done:
            del self._handshakes[address]  # taken (or failed) by every read waiting on it

    def _overdue(self, read: _Read) -> bool:
        return read.spec.key in self._cancelled or time.monotonic() > read.deadline

    def _remote(self, read: _Read) -> hs.KVLayout | None:
        """The paired prefill rank's layout, its agent added (None: the handshake runs)."""
        address, engine_id = read.address, read.spec.remote_engine_id
        known = self._remotes.get(address)
        if known is not None and known.engine_id == engine_id:
            return known
        if known is not None:  # another instance took the address: forget the old one
            self._forget(address)
        pending = self._handshakes.get(address)
        if pending is None:
            self._handshakes[address] = self._fetch(address)
            return None
        if not pending.done():
            return None
        layout = pending.result().layout
        problem = layout.mismatch(self._layout)
        if problem is None and layout.engine_id != engine_id:
            problem = (f"the prefill instance at {address[0]}:{address[1]} is "
                       f"{layout.engine_id}, not the transfer's {engine_id}")
        if problem is not None:
            raise KVTransferError(problem)
        self._agent.add_remote_agent(pending.result().agent_metadata)
        self._remotes[address] = layout
        return layout

    def _fetch(self, address: Address) -> Future[hs.Handshake]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2,
                                            thread_name_prefix="photon-kv-nixl-handshake")
        future = self._pool.submit(hs.fetch, *address, _HANDSHAKE_TIMEOUT_S)
        future.add_done_callback(lambda _: self._progress.set())
        return future

    def _try_post(self, read: _Read) -> None:
        remote = self._remote(read)
        if remote is None:
            return
        spec = read.spec
        if not spec.block_ids:  # nothing to load: release the prefill instance's blocks
            self._agent.send_notif(remote.agent_name, notification(spec.remote_request_id, 0))
            self._finish(read, nbytes=0)
            return
        local_descs, remote_descs, nbytes = self._descriptors(spec, remote)
        read.nbytes, read.started = nbytes, time.monotonic()
        handle = self._agent.initialize_xfer(
            "READ", local_descs, remote_descs, remote.agent_name,
            notification(spec.remote_request_id, nbytes))
        read.handle = handle
        try:
            state = self._agent.transfer(handle)  # raises when the prefill agent is gone
        except Exception:
            state = "ERR"
        if state == "ERR":
            self._release(read)
            self._forget(read.address)  # dead or restarted: the next load handshakes anew
            raise KVTransferError("NIXL could not start the READ of the prefill instance's "
                                  "KV cache (the prefill instance may be gone)")

    def _descriptors(self, spec: LoadSpec, remote: hs.KVLayout) -> tuple[Any, Any, int]:
        """The READ's local and remote descriptor lists (in the same order) and its bytes."""
        src, dst = spec.remote_block_ids, spec.block_ids
        if len(src) != len(dst):
            raise ValueError(f"kv_transfer_params.remote_block_ids name {len(src)} blocks past "
                             f"block {spec.first_block}; the prompt needs {len(dst)}")
        bad = [b for b in src if b >= remote.num_blocks]
        if bad:
            raise ValueError(f"kv_transfer_params.remote_block_ids: block {bad[0]} is not one "
                             f"of the prefill instance's {remote.num_blocks} blocks")
        local, size = self._layout, remote.block_bytes
        mine, theirs = [], []
        for s, d, n in _runs(src, dst):
            for layer in range(len(local.k_addrs)):
                for lbase, rbase in ((local.k_addrs[layer], remote.k_addrs[layer]),
                                     (local.v_addrs[layer], remote.v_addrs[layer])):
                    mine.append((lbase + d * size, n * size, local.device_id))
                    theirs.append((rbase + s * size, n * size, remote.device_id))
        return (self._agent.get_xfer_descs(mine, local.mem),
                self._agent.get_xfer_descs(theirs, remote.mem),
                len(dst) * size * 2 * len(local.k_addrs))

    def _poll(self, read: _Read) -> None:
        state = self._agent.check_xfer_state(read.handle)
        if state == "DONE":
            self._release(read)
            self.count(bytes_received=read.nbytes, num_received=1,
                       receive_seconds=time.monotonic() - read.started)
            self._finish(read, nbytes=read.nbytes)
        elif state == "ERR":
            self._release(read)
            self._forget(read.address)  # its state is unknown: the next load handshakes anew
            raise KVTransferError("the NIXL READ of the prefill instance's KV cache failed")
        elif self._overdue(read) and self._release(read):  # aborted in flight
            if read.spec.key not in self._cancelled:
                self._forget(read.address)  # dead or stuck: the next load handshakes anew
            raise KVTransferTimeout("the KV cache did not arrive in time")

    def _release(self, read: _Read) -> bool:
        """Release (an in-flight one: abort) the READ; False if NIXL cannot yet: its blocks
        may still be written, so the load stays in flight."""
        try:
            self._agent.release_xfer_handle(read.handle)
        except Exception:  # noqa: BLE001 - NIXL could not abort it yet
            return False
        read.handle = None
        return True

    def _finish(self, read: _Read, nbytes: int = 0, error: BaseException | None = None) -> None:
        if read.handle is not None and not self._release(read):
            return  # still in flight: its blocks stay held until NIXL lets go of them
        self._reads.remove(read)
        if error is not None:
            read.future.set_exception(error)
        else:
            read.future.set_result(nbytes)
        self._progress.set()

    def _forget(self, address: Address) -> None:
        """Drop the prefill rank's agent, unless another READ from it is still in flight (the
        last of them drops it)."""
        if any(r.handle is not None and r.address == address for r in self._reads):
            return
        layout = self._remotes.pop(address, None)
        if layout is not None:
            try:
                self._agent.remove_remote_agent(layout.agent_name)
            except Exception:  # noqa: BLE001 - already gone
                pass

    # ---- worker side: offers (producer) ---------------------------------------------------
    def wait_for_save(self) -> None:
        """Offer the step's saves: nothing moves here, the decode instance reads the blocks."""
        meta = self._metadata
        if meta is None or self._server is None:
            return
        now = time.monotonic()
        for spec in meta.saves:
            self._offers[spec.transfer_id] = _Offer(spec.key, now)
            early = self._early.pop(spec.transfer_id, None)
            if early is not None:  # read before this step offered it
                self._taken(spec.transfer_id, early[0])

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
        self._sent.add(self._offers.pop(transfer_id).key)
        if nbytes:
            self.count(bytes_sent=nbytes, num_sent=1)

    def _expire(self) -> None:
        """End the leases nobody took in time (their blocks are freed)."""
        now, lease = time.monotonic(), self.extra.timeout_s
        old = [t for t, o in self._offers.items() if now - o.registered > lease]
        for transfer_id in old:
            self._sent.add(self._offers.pop(transfer_id).key)
        if old:
            self.count(num_expired_leases=len(old))
        for transfer_id in [t for t, (_, at) in self._early.items() if now - at > lease]:
            del self._early[transfer_id]

    # ---- worker side: every step ----------------------------------------------------------
    def start_load_kv(self) -> None:
        super().start_load_kv()
        self._advance()

    def get_finished(self) -> tuple[set[int], set[int]]:
        self._advance()
        if self._server is not None:
            self._take_notifications()
            self._expire()
        sent, self._sent = self._sent, set()
        return sent, self.finished_loads()

    def has_pending(self) -> bool:
        return bool(self._loads or self._reads or self._offers or self._sent)

    def wait_for_progress(self, timeout: float) -> None:
        """READs and notifications are polled, not signalled: wait briefly while any pend."""
        if self._offers or any(read.handle is not None for read in self._reads):
            timeout = min(timeout, _POLL_S)
        super().wait_for_progress(timeout)

    def close(self) -> None:
        """Abort the READs in flight, stop the handshakes, let the agent go."""
        for read in self._reads:
            if read.handle is not None:
                self._release(read)
        if self._server is not None:
            self._server.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for address in list(self._remotes):
            self._forget(address)
        self._agent = None


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, count) of the runs of blocks that are
    consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
