"""EventSubscriber: one thread per backend that feeds the PrefixIndex from its KV events.

vLLM's transport: a PUB socket sends `(topic, seq, payload)` (seq: 8 bytes big-endian, one per
batch); a ROUTER replay socket answers `start seq` (8 bytes) with every buffered batch from there
as `(seq, payload)` frames, then an end marker (seq -1, empty payload). This thread subscribes
to every topic, and on a sequence gap asks for the missed batches (and, at its first batch,
for whatever the publisher still buffers from seq 0: what the backend cached before the router
started). When the replay cannot fill the gap (no replay socket, or the publisher's buffer has
moved on), the backend's entries are dropped: a removal may be among the lost batches, and an
index that claims too little only costs a cache hit, one that claims too much misroutes. A
sequence number that goes backwards means the publisher restarted (an empty cache): the same.

Decoding and hashing run outside the index lock; only `PrefixIndex.apply` takes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import zmq

from photon.router.events import BlockStored, EventDecodeError, EventDecoder, KVEventBatch
from photon.router.hashing import BlockHasher
from photon.router.index import PrefixIndex

log = logging.getLogger("photon.router")

END_SEQ = -1
POLL_MS = 100  # how often the thread looks at its stop flag


@dataclass
class SubscriberStats:
    """Written by the subscriber thread only; read (racily, as plain ints) by /metrics."""
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    resets: int = 0  # the backend's entries dropped: restart or an unfillable gap
    decode_errors: int = 0
    hash_mismatches: int = 0


@dataclass(frozen=True)
class SubscriberConfig:
    backend: str
    endpoint: str
    replay_endpoint: str | None
    block_size: int
    replay_timeout_s: float = 1.0


def replay_endpoint_for(endpoint: str) -> str | None:
    """The replay socket beside a `tcp://host:port` events endpoint: port + 1 (as vLLM's
    examples pair 5557 with 5558); None for other transports."""
    if not endpoint.startswith("tcp://"):
        return None
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    return f"tcp://{host}:{int(port) + 1}" if sep and port.isdigit() else None


def chain_matches(event: BlockStored, hasher: BlockHasher, block_size: int) -> bool | None:
    """Whether the router's hash of a chain root's tokens equals the engine's (None: the event
    does not start a chain, so the router cannot recompute it)."""
    if event.parent_block_hash is not None or not event.block_hashes:
        return None
    expected = hasher(event.token_ids, block_size)
    return expected == list(event.block_hashes[:len(expected)]) and len(expected) > 0


class EventSubscriber:
    def __init__(self, config: SubscriberConfig, index: PrefixIndex, decoder: EventDecoder,
                 hasher: BlockHasher, context: zmq.Context) -> None:
        self.config = config
        self.index = index
        self.decoder = decoder
        self.hasher = hasher
        self.stats = SubscriberStats()
        self._context = context
        self._stop = threading.Event()
        self._last_seq = -1
        self._warned = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"photon-router-events-{config.backend}")

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.config.endpoint)
        try:
            while not self._stop.is_set():
                if sub.poll(POLL_MS):
                    frames = sub.recv_multipart()
                    if len(frames) >= 2:
                        self.on_message(int.from_bytes(frames[-2], "big"), frames[-1])
        except zmq.ZMQError as e:  # the context was terminated under us: shutting down
            log.debug("event subscriber for %s stops: %s", self.config.backend, e)
        finally:
            sub.close(linger=0)

    def on_message(self, seq: int, payload: bytes) -> None:
        """One live batch: fill a gap before it (replay), then apply it."""
        last = self._last_seq
        if last >= 0 and seq <= last:
            self._reset(f"sequence went back from {last} to {seq} (publisher restarted)")
        elif seq > last + 1:
            self.stats.gaps += last >= 0
            self._fill(last + 1, seq)
        self._apply(seq, payload)

    def _fill(self, start: int, end: int) -> None:
        """Apply batches start..end-1 from the replay socket; reset when some cannot be had."""
        got = start
        for seq, payload in self._replay(start):
            if seq < got or seq >= end:
                continue
            if seq != got:
                break
            self._apply(seq, payload)
            self.stats.replayed += 1
            got += 1
        if got < end and start > 0:
            self._reset(f"batches {got}..{end - 1} were missed and could not be replayed")

    def _replay(self, start: int) -> Iterator[tuple[int, bytes]]:
        endpoint = self.config.replay_endpoint
        if endpoint is None:
            return
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            timeout_ms = int(self.config.replay_timeout_s * 1000)
            while not self._stop.is_set() and sock.poll(timeout_ms):
                frames = sock.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True) if len(frames) >= 2 else END_SEQ
                if seq == END_SEQ or not frames[-1]:
                    return
                yield seq, frames[-1]
        finally:
            sock.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        self._last_seq = seq
        try:
            batch = self.decoder(payload)
        except EventDecodeError as e:
            self.stats.decode_errors += 1
            self._reset(f"batch {seq} could not be decoded: {e}")
            return
        self._check_hashes(batch)
        self.index.apply(self.config.backend, batch)
        self.stats.batches += 1

    def _check_hashes(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored) and \
                    chain_matches(event, self.hasher, self.config.block_size) is False:
                self.stats.hash_mismatches += 1
                if not self._warned:
                    self._warned = True
                    log.warning("%s: its block hashes differ from the router's (check "
                                "--block-size and that the router hashes as the engine does); "
                                "prefix_aware cannot find its cached prefixes",
                                self.config.backend)

    def _reset(self, why: str) -> None:
        log.info("%s: dropping its prefix index entries: %s", self.config.backend, why)
        self.stats.resets += 1
        self.index.drop(self.config.backend)
