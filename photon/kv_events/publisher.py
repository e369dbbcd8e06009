"""Event publishers: the engine hands each step's KV cache events to one; "zmq" sends them.

`ZmqEventPublisher` (vLLM's protocol): a background thread owns a PUB socket and, with a
replay_endpoint, a ROUTER socket. Each batch goes out as a 3-frame message
    (topic, seq as 8-byte big-endian, msgpack payload)
with seq counting 0, 1, 2... per publisher. The last `buffer_steps` payloads are kept: a
subscriber that sees a gap sends the first seq it missed (8-byte big-endian) to the replay socket
and gets, per buffered batch from there on, (seq, payload), then (-1 as 8-byte signed, b"").
(With a DEALER socket, frames are preceded by an empty delimiter frame, as for REQ.)

The engine thread only stamps a batch with its seq and puts it on a bounded queue: it never
encodes, sends or waits. A full queue drops the batch and counts it (`dropped`); its seq is used
up, so subscribers see the gap, and replay cannot fill it (their index may be stale from there:
see docs/kv-events.md).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections import deque

import msgspec
import zmq

from photon.kv_events.config import KVEventsConfig, offset_endpoint_port
from photon.kv_events.schema import KVCacheEvent, KVEventBatch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_JOIN_TIMEOUT_S = 5.0


class NullEventPublisher:
    """Publishes nothing (KV events off, or publisher "null")."""

    dropped = 0
    endpoint: str | None = None
    replay_endpoint: str | None = None

    def publish(self, events: list[KVCacheEvent]) -> None:
        return

    def shutdown(self) -> None:
        return


EventPublisher = NullEventPublisher  # the interface: publish, shutdown, dropped


def _bind_or_connect(sock: zmq.Socket, endpoint: str) -> None:
    """As vLLM: a wildcard host (`*`, `::`), ipc:// or inproc:// binds; anything else connects."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class _SenderThread:
    """The publisher thread's state: it alone uses the sockets and the replay buffer."""

    def __init__(self, pub: zmq.Socket, replay: zmq.Socket | None, topic: bytes,
                 buffer_steps: int, batches: queue.Queue, wake_fd: int) -> None:
        self.pub = pub
        self.replay = replay
        self.topic = topic
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.batches = batches
        self.wake_fd = wake_fd
        self.stopping = False  # set by the owner before its last wake-up
        self.encoder = msgspec.msgpack.Encoder()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.wake_fd, zmq.POLLIN)
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self.wake_fd in ready:
                    os.read(self.wake_fd, 65536)
                stopping = self.stopping  # read before draining: nothing queued is left behind
                self._send_queued()
                if self.replay is not None and self.replay in ready:
                    self._serve_replays()
                if stopping:
                    return
        finally:
            self.pub.close(linger=0)
            if self.replay is not None:
                self.replay.close(linger=0)

    def _send_queued(self) -> None:
        while True:
            try:
                seq, batch = self.batches.get_nowait()
            except queue.Empty:
                return
            payload = self.encoder.encode(batch)
            # PUB never blocks: past its high-water mark a slow subscriber loses messages.
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self.buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        assert self.replay is not None
        while True:
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events replay: ignoring a malformed request (%d frames)",
                               len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", END_SEQ, b""))


class ZmqEventPublisher:
    """Publishes batches over ZeroMQ from a background thread (see the module docstring).
    `publish` and `shutdown` are called from one thread (the engine's)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.dropped = 0  # batches dropped because the queue was full (engine thread)
        self._seq = itertools.count()
        self._batches: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._ctx = zmq.Context()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        try:
            pub, replay = self._open_sockets(config, data_parallel_rank)
        except BaseException:
            self._close_fds()
            self._ctx.term()
            raise
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self.replay_endpoint = None if replay is None \
            else replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sender = _SenderThread(pub, replay, config.topic.encode(), config.buffer_steps,
                                     self._batches, self._wake_r)
        self._thread = threading.Thread(target=self._sender.run, name="kv-events-publisher",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        # An engine dropped without shutdown() still stops the thread and frees the sockets.
        self._finalizer = weakref.finalize(self, _stop, self._sender, self._thread, self._ctx,
                                           self._wake_r, self._wake_w)

    def _open_sockets(self, config: KVEventsConfig, rank: int
                      ) -> tuple[zmq.Socket, zmq.Socket | None]:
        endpoint = offset_endpoint_port(config.endpoint, rank)
        replay_endpoint = offset_endpoint_port(config.replay_endpoint, rank)
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(config.hwm)
        try:
            _bind_or_connect(pub, endpoint)
            if replay_endpoint is None:
                return pub, None
            replay = self._ctx.socket(zmq.ROUTER)
            try:
                replay.bind(replay_endpoint)
            except zmq.ZMQError as e:
                replay.close(linger=0)
                raise OSError(f"kv_events_config: cannot bind replay_endpoint "
                              f"{replay_endpoint!r}: {e}") from None
            return pub, replay
        except zmq.ZMQError as e:
            pub.close(linger=0)
            raise OSError(f"kv_events_config: cannot open endpoint {endpoint!r}: {e}") from None
        except BaseException:
            pub.close(linger=0)
            raise

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events as a batch (never blocks; dropped and counted when the
        queue is full or the publisher is shut down)."""
        seq = next(self._seq)
        if self._closed:
            self.dropped += 1
            return
        try:
            self._batches.put_nowait((seq, KVEventBatch(time.time(), events,
                                                        self.data_parallel_rank)))
        except queue.Full:
            self.dropped += 1
            return
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the thread will drain the queue

    def shutdown(self) -> None:
        """Send what is queued, stop the thread, close the sockets (idempotent)."""
        self._closed = True
        self._finalizer()

    @property
    def thread_alive(self) -> bool:
        return self._thread.is_alive()

    def _close_fds(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)


def _stop(sender: _SenderThread, thread: threading.Thread, ctx: zmq.Context, wake_r: int,
          wake_w: int) -> None:
    sender.stopping = True
    try:
        os.write(wake_w, b"\0")
    except BlockingIOError:
        pass
    thread.join(_JOIN_TIMEOUT_S)
    if thread.is_alive():
        logger.warning("KV events publisher thread did not stop in %.0f s", _JOIN_TIMEOUT_S)
        return  # it still uses the sockets and the pipe: leave them to process exit
    os.close(wake_r)
    os.close(wake_w)
    ctx.term()


def create_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0
                     ) -> NullEventPublisher | ZmqEventPublisher:
    """The publisher `config` asks for: ZmqEventPublisher when events are enabled with publisher
    "zmq", else a NullEventPublisher."""
    if config is None or not config.publishes:
        return NullEventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank)
