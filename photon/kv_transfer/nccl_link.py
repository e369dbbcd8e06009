"""The NcclConnector's two ends: `ProducerEndpoint` (a prefill instance) and `ConsumerLink` (a
decode instance's connection to one prefill instance).

Rendezvous: the producer hosts a TCPStore on kv_ip:kv_port. A consumer connects, takes a pair
number n (`peers` counter) and both build the two-rank group of pair n (producer rank 0,
consumer rank 1; NCCL for CUDA caches, gloo otherwise) under the store prefix `pair/n/`.
Control messages go through the store, the KV through the group:
  consumer  `pair/n/ask/<seq>`    {"transfer", "first", "count", "rank"} (count 0: release
                                  it; rank: the consumer's tensor-parallel rank), or
                                  {"close": true} (the consumer drops the pair)
  producer  `pair/n/answer/<seq>` "ok", or why not
  then, for count > 0, KVSender -> KVReceiver (photon/kv_transfer/p2p.py): a checked header and
  the blocks [first, first + count) of the transfer's blocks, layer by layer.
With tensor parallelism every rank of the prefill instance hosts a rendezvous of its own and
rank r of a decode instance pairs with rank r only (its shard): an ask of another rank is
refused before the transfer is touched.
One pair carries one transfer at a time, in ask order (a thread on each side). Every wait is
bounded by the transfer's deadline and ends early when the engine stops; after a failed
transfer both sides discard the pair (its group's state is unknown).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from photon.kv_transfer.p2p import KVReceiver, KVSender, KVTransferError, PairGroup, pair_group

_POLL_MAX_S = 0.02  # the longest pause between two polls of the store (a transfer thread's)


@dataclass
class Offer:
    """A finished prefill's blocks, waiting for a decode instance to ask for them."""

    key: int
    block_ids: list[int]
    registered: float  # time.monotonic(): the lease's start
    ready: torch.cuda.Event | None = None  # CUDA: the step that wrote the blocks is done


@dataclass(frozen=True)
class Ask:
    transfer_id: str
    first: int
    count: int
    rank: int = 0  # the consumer's tensor-parallel rank (the shard it stores)

    def to_json(self) -> str:
        return json.dumps({"transfer": self.transfer_id, "first": self.first,
                           "count": self.count, "rank": self.rank})


def _poll(ready: Callable[[], bool], deadline: float, stopped: Callable[[], bool],
          what: str) -> None:
    """Until `ready()`; TimeoutError past `deadline`, InterruptedError once `stopped()`."""
    delay = 1e-3
    while not ready():
        if stopped():
            raise InterruptedError(f"stopped while {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out while {what}")
        time.sleep(delay)  # a transfer thread's poll interval, never the engine loop's
        delay = min(delay * 2, _POLL_MAX_S)


class ProducerEndpoint:
    """The prefill side: the rendezvous store, a thread accepting pairs, one thread per pair
    serving its asks. `offers` is owned here (under `lock`): registered by the engine loop,
    claimed by a pair thread or expired by the engine loop, never both."""

    def __init__(self, host: str, port: int, caches: list[torch.Tensor], timeout_s: float,
                 on_sent: Callable[[int, float], None], progress: threading.Event,
                 serve: bool = True, rank: int = 0) -> None:
        self.rank = rank  # this rank's shard: it serves the asks of the consumers' rank only
        self.store = dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.caches, self.timeout_s, self.on_sent = caches, timeout_s, on_sent
        self.serve = serve  # False (fault injection): asks are never answered
        self.lock = threading.Lock()
        self.offers: dict[str, Offer] = {}
        self.done: set[int] = set()  # keys whose blocks no transfer reads any more
        self.stop = threading.Event()
        self.progress = progress  # set when a transfer ends (the engine may wait on it)
        self.stream = torch.cuda.Stream(caches[0].device) if caches[0].is_cuda else None
        self._threads = [threading.Thread(target=self._accept, name="photon-kv-accept",
                                          daemon=True)]
        self._threads[0].start()

    @property
    def port(self) -> int:
        return self.store.port

    def offer(self, transfer_id: str, offer: Offer) -> None:
        with self.lock:
            self.offers[transfer_id] = offer

    def release(self, key: int) -> None:
        with self.lock:
            self.done.add(key)

    def finished(self) -> set[int]:
        with self.lock:
            done, self.done = self.done, set()
        return done

    def expire(self, now: float) -> int:
        """Give up the offers nobody asked for within the lease; how many."""
        with self.lock:
            old = [t for t, o in self.offers.items() if now - o.registered > self.timeout_s]
            for t in old:
                self.done.add(self.offers.pop(t).key)
        return len(old)

    def pending(self) -> bool:
        with self.lock:
            return bool(self.offers)

    def _accept(self) -> None:
        accepted = 0
        while not self.stop.is_set():
            try:
                peers = self.store.add("peers", 0)
            except RuntimeError:
                return  # the store is gone: the engine shuts down
            for n in range(accepted, peers):
                t = threading.Thread(target=self._serve_pair, args=(n,), daemon=True,
                                     name=f"photon-kv-pair-{n}")
                self._threads.append(t)
                t.start()
            accepted = peers
            self.stop.wait(_POLL_MAX_S)

    def _serve_pair(self, n: int) -> None:
        """Answer pair n's asks in order until it closes, fails or the engine stops."""
        ctl = dist.PrefixStore(f"pair/{n}/", self.store)
        try:
            group = pair_group(dist.PrefixStore("group/", ctl), 0, self.caches[0].device,
                               self.timeout_s)
        except RuntimeError:
            return  # the consumer went away before the group formed
        sender = KVSender(self.caches, peer=1, group=group, timeout_s=self.timeout_s)
        seq = 0
        try:
            while not self.stop.is_set():
                key = f"ask/{seq}"
                _poll(lambda k=key: ctl.check([k]), float("inf"), self.stop.is_set,
                      "waiting for an ask")
                ask = json.loads(ctl.get(key))
                if ask.get("close") or not self._answer(ctl, seq, sender, Ask(
                        ask["transfer"], ask["first"], ask["count"], ask.get("rank", 0))):
                    return
                seq += 1
        except (InterruptedError, RuntimeError, ValueError, KeyError, TypeError):
            return
        finally:
            group.close()

    def _claim(self, transfer_id: str) -> Offer | None:
        """The offer, taken from `offers` (it may be registered a step after its ask)."""
        def ready() -> bool:
            with self.lock:
                return transfer_id in self.offers

        try:
            _poll(ready, time.monotonic() + self.timeout_s, self.stop.is_set,
                  "waiting for the transfer's blocks")
        except (TimeoutError, InterruptedError):
            return None
        with self.lock:
            return self.offers.pop(transfer_id, None)

    def _answer(self, ctl: dist.Store, seq: int, sender: KVSender, ask: Ask) -> bool:
        """Serve one ask; False if the pair must be discarded."""
        if not self.serve:
            return True
        if ask.rank != self.rank:  # another shard's ask: its transfer stays offered
            ctl.set(f"answer/{seq}", f"the prefill instance's rank {self.rank} holds the KV "
                                     f"shard of rank {self.rank}, not of rank {ask.rank}")
            return True
        offer = self._claim(ask.transfer_id)
        if offer is None:
            ctl.set(f"answer/{seq}", f"the prefill instance has no transfer {ask.transfer_id!r}"
                                     f" (expired, taken or never made)")
            return True
        try:
            if not 0 <= ask.first <= ask.first + ask.count <= len(offer.block_ids):
                ctl.set(f"answer/{seq}", f"blocks [{ask.first}, {ask.first + ask.count}) are "
                                         f"not in the transfer's {len(offer.block_ids)} blocks")
                return True
            ctl.set(f"answer/{seq}", "ok")
            if ask.count:
                self._send(sender, ask, offer)
            return True
        except (KVTransferError, RuntimeError):
            return False
        finally:
            self.release(offer.key)
            self.progress.set()

    def _send(self, sender: KVSender, ask: Ask, offer: Offer) -> None:
        t0 = time.monotonic()
        ids = offer.block_ids[ask.first:ask.first + ask.count]
        if self.stream is None:
            nbytes = sender.send(ask.transfer_id, ids)
        else:
            with torch.cuda.stream(self.stream):
                if offer.ready is not None:
                    self.stream.wait_event(offer.ready)
                nbytes = sender.send(ask.transfer_id, ids)
        self.on_sent(nbytes, time.monotonic() - t0)

    def close(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(self.timeout_s)


class ConsumerLink:
    """A decode instance's pair with one prefill instance (used by one transfer thread)."""

    def __init__(self, host: str, port: int, caches: list[torch.Tensor],
                 stop: threading.Event) -> None:
        self.host, self.port, self.caches, self.stop = host, port, caches, stop
        self.stream = torch.cuda.Stream(caches[0].device) if caches[0].is_cuda else None
        self._ctl: dist.Store | None = None
        self._group: PairGroup | None = None
        self._seq = 0

    def _connect(self, deadline: float) -> None:
        left = max(deadline - time.monotonic(), 1e-3)
        # a dead prefill instance refuses at once (the store's client would retry until left)
        socket.create_connection((self.host, self.port), timeout=left).close()
        store = dist.TCPStore(self.host, self.port, None, False, timeout=timedelta(seconds=left))
        n = store.add("peers", 1) - 1
        ctl = dist.PrefixStore(f"pair/{n}/", store)
        self._group = pair_group(dist.PrefixStore("group/", ctl), 1, self.caches[0].device,
                                 max(deadline - time.monotonic(), 1e-3))
        self._ctl, self._seq = ctl, 0

    def load(self, ask: Ask, block_ids: list[int], deadline: float,
             cancelled: Callable[[], bool]) -> int:
        """Ask for the transfer and receive it into `block_ids`; the bytes received. Raises
        (and drops the pair when its state is unknown) on any failure."""
        try:
            if self._group is None:
                self._connect(deadline)
            seq, ctl = self._seq, self._ctl
            self._seq += 1
            ctl.set(f"ask/{seq}", ask.to_json())
            if not ask.count:
                return 0
            key = f"answer/{seq}"
            _poll(lambda: ctl.check([key]), deadline,
                  lambda: self.stop.is_set() or cancelled(), "waiting for the prefill instance")
            answer = ctl.get(key).decode()
            if answer != "ok":
                raise KVTransferError(answer)
            return self._receive(ask, block_ids, deadline)
        except BaseException:
            self.drop()
            raise

    def _receive(self, ask: Ask, block_ids: list[int], deadline: float) -> int:
        left = max(deadline - time.monotonic(), 1e-3)
        receiver = KVReceiver(self.caches, peer=0, group=self._group, timeout_s=left)
        if self.stream is None:
            receiver.recv(block_ids, request_id=ask.transfer_id)
        else:
            with torch.cuda.stream(self.stream):
                receiver.recv(block_ids, request_id=ask.transfer_id)
            self.stream.synchronize()  # the blocks are written before the engine reads them
        return receiver.bytes

    def drop(self) -> None:
        """Tell the producer (if it listens) and discard the pair; the next load reconnects."""
        if self._ctl is not None:
            try:
                self._ctl.set(f"ask/{self._seq}", json.dumps({"close": True}))
            except RuntimeError:
                pass  # the producer is gone
        if self._group is not None:
            self._group.close()
        self._ctl, self._group = None, None
