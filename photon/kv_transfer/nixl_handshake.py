"""The NixlConnector's side channel: a prefill instance's rank tells a decode instance's rank
its NIXL agent's metadata and its KV layout, once per pair (the decode side caches it).

Wire (plain TCP, one exchange per connection): the server sends a 4-byte big-endian length and
the layout as JSON, then a 4-byte length and the agent metadata, and closes. Nothing is read
from the client: the answer is the same for everyone, fixed at start.

`KVLayout` says where each layer's K and V blocks live: photon's caches are one contiguous tensor
per layer shaped [2, num_blocks, block_size, heads, head_dim], so block b of K (V) is
`k_addrs[layer] + b * block_bytes` and a run of consecutive blocks is one contiguous range.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from dataclasses import asdict, dataclass

import torch

_POLL_S = 0.1  # how often the accept loop looks at its stop flag
_MAX_FRAME = 64 << 20


@dataclass(frozen=True)
class KVLayout:
    engine_id: str
    agent_name: str
    tp_rank: int
    dtype: str
    block_shape: list[int]  # [block_size, heads, head_dim]
    num_blocks: int
    block_bytes: int  # one block of K (or of V) of one layer
    k_addrs: list[int]  # per layer
    v_addrs: list[int]
    mem: str  # NIXL's memory type: DRAM (host) or VRAM (a CUDA device)
    device_id: int  # the CUDA device's index (0 on the host)

    @classmethod
    def of(cls, caches: list[torch.Tensor], engine_id: str, agent_name: str,
           tp_rank: int) -> KVLayout:
        first = caches[0]
        return cls(engine_id, agent_name, tp_rank, str(first.dtype), list(first.shape[2:]),
                   first.shape[1], first[0, 0].numel() * first.element_size(),
                   [c[0].data_ptr() for c in caches], [c[1].data_ptr() for c in caches],
                   "VRAM" if first.is_cuda else "DRAM", max(first.get_device(), 0))

    def mismatch(self, local: KVLayout) -> str | None:
        """Why this (remote) layout cannot fill `local`'s blocks (None: it can)."""
        if self.tp_rank != local.tp_rank:
            return (f"the prefill instance's rank {self.tp_rank} answered on the port of rank "
                    f"{local.tp_rank}")
        mine = (len(local.k_addrs), local.dtype, local.block_shape)
        theirs = (len(self.k_addrs), self.dtype, self.block_shape)
        if mine != theirs:
            return (f"the prefill instance's KV layout (layers, dtype, block shape) {theirs} "
                    f"does not match this instance's {mine}")
        return None

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> KVLayout:
        return cls(**json.loads(data))


@dataclass(frozen=True)
class Handshake:
    layout: KVLayout
    agent_metadata: bytes


def _frame(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _read_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the prefill instance closed the handshake early")
        buf += chunk
    return bytes(buf)


def _read_frame(conn: socket.socket) -> bytes:
    (n,) = struct.unpack(">I", _read_exact(conn, 4))
    if n > _MAX_FRAME:
        raise ConnectionError(f"the handshake's frame of {n} bytes is too large")
    return _read_exact(conn, n)


def fetch(host: str, port: int, timeout_s: float) -> Handshake:
    """The prefill rank's layout and agent metadata (raises OSError / ValueError)."""
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        layout = KVLayout.from_bytes(_read_frame(conn))
        return Handshake(layout, _read_frame(conn))


class HandshakeServer:
    """Answers every connection with the fixed handshake, on a thread of its own."""

    def __init__(self, host: str, port: int, answer: Handshake) -> None:
        self._payload = _frame(answer.layout.to_bytes()) + _frame(answer.agent_metadata)
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(_POLL_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="photon-kv-nixl-handshake",
                                        daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(_POLL_S * 10)
                    conn.sendall(self._payload)
                except OSError:
                    pass  # the decode side went away: its load fails there

    def close(self) -> None:
        self._stop.set()
        self._thread.join(_POLL_S * 20)
        self._sock.close()
