"""The NixlConnector's loads on the decode side: `Reads` owns them from the handshake to the
READ's end. Only the connector's transfer thread calls it (every NIXL call of the agent runs
there, so the agent needs no locking); the engine loop sees a load through its future.

A load waits for the handshake with its prefill rank (a handshake thread reads the socket;
cached per address, and done anew when another engine id answers there or a READ failed),
then posts one NIXL READ of its blocks: per layer, for K and for V, one descriptor per run of
blocks consecutive on both sides, with the transfer's id (and its bytes) as the notification.
A load with no blocks sends the notification alone (the prefill instance frees its blocks).
A READ that fails, or is not done by the deadline (or whose request was aborted), is released
(aborted in NIXL) and its load fails; one NIXL cannot release yet stays in flight, its blocks
held, until NIXL lets go of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from photon.kv_transfer import nixl_handshake as hs
from photon.kv_transfer.p2p import KVTransferError, KVTransferTimeout

if TYPE_CHECKING:
    from photon.kv_transfer.metadata import LoadSpec

_HANDSHAKE_TIMEOUT_S = 10.0  # bound on one handshake (the load's deadline bounds it too)

Address = tuple[str, int]


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


def read_of(spec: LoadSpec, port: int | None, deadline: float, future: Future[int]) -> _Read:
    return _Read(spec, (spec.remote_host or "", port or 0), deadline, future)


def notification(transfer_id: str, nbytes: int) -> bytes:
    return f"{transfer_id}:{nbytes}".encode()


def parse_notification(message: bytes) -> tuple[str, int] | None:
    transfer_id, _, nbytes = message.decode(errors="replace").rpartition(":")
    return (transfer_id, int(nbytes)) if transfer_id and nbytes.isdigit() else None


class Reads:
    """The decode side's loads in flight, and the prefill ranks it handshook with."""

    def __init__(self, agent: Any, layout: hs.KVLayout, cancelled: set[int],
                 wake: Callable[[], None], ended: Callable[[], None],
                 count: Callable[..., None]) -> None:
        self._agent, self._layout = agent, layout
        self._cancelled = cancelled  # keys of aborted loads (the engine loop adds to it)
        self._wake = wake  # a handshake ended: the transfer thread looks again
        self._ended = ended  # a load ended: the engine loop looks again
        self.count = count
        self._pool: ThreadPoolExecutor | None = None
        self._handshakes: dict[Address, Future[hs.Handshake]] = {}
        self._remotes: dict[Address, hs.KVLayout] = {}
        self._reads: list[_Read] = []

    def add(self, read: _Read) -> None:
        self._reads.append(read)

    def pending(self) -> bool:
        return bool(self._reads)

    def advance(self) -> None:
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
        future.add_done_callback(lambda _: self._wake())
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
        self._ended()

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

    def close(self) -> None:
        """Abort the READs in flight, stop the handshakes, forget the prefill agents."""
        for read in self._reads:
            if read.handle is not None:
                self._release(read)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for address in list(self._remotes):
            self._forget(address)


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
