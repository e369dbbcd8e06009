"""The subscriber side of KV events, for routers and tests: read one published message, ask the
replay socket for missed batches."""

from __future__ import annotations

import zmq

from photon.kv_events.publisher import END_SEQ
from photon.kv_events.schema import KVEventBatch, decode_event_batch


def parse_message(frames: list[bytes]) -> tuple[bytes, int, KVEventBatch]:
    """A PUB message (topic, seq, payload) -> (topic, seq, batch); ValueError if malformed."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"a KV events message has 3 frames (topic, 8-byte seq, payload), "
                         f"got {len(frames)}")
    return frames[0], int.from_bytes(frames[1], "big"), decode_event_batch(frames[2])


def replay(ctx: zmq.Context, replay_endpoint: str, start_seq: int, timeout_s: float = 5.0
           ) -> list[tuple[int, KVEventBatch]]:
    """The batches from `start_seq` on that the publisher still buffers, in order. TimeoutError
    when the publisher does not answer within `timeout_s` (per message)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(replay_endpoint)
        sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
        batches = []
        while True:
            if not sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no replay answer from {replay_endpoint} in {timeout_s} s")
            _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return batches
            batches.append((int.from_bytes(seq, "big"), decode_event_batch(payload)))
    finally:
        sock.close()
