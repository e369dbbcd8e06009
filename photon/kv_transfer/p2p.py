"""Point-to-point KV cache transfer over torch.distributed (send/recv; gloo and NCCL alike).

A `KVSender` on the producer moves the K/V of a list of its blocks, for every layer, into the
blocks a `KVReceiver` on the consumer names, layer by layer, so a sender can send a layer as
soon as the forward pass has written it. The caches are photon's, one tensor per layer shaped
[2, num_blocks, block_size, num_kv_heads, head_dim] ([0] = K, [1] = V); both sides' layouts
must agree (block count may differ).

The protocol, over the two ranks' process group (tensors on the caches' device, so NCCL works):
  sender -> receiver   header: request id, layer count, block count, block layout, dtype
  receiver -> sender   status: accepted, or why not (checked against the receiver's request)
  sender -> receiver   per layer: the blocks' K/V, [2, num_blocks, block_size, heads, dim]
  receiver -> sender   status: every layer stored
Every wait is bounded by `timeout_s`: a peer that died or stopped answering raises
KVTransferTimeout (or KVTransferError when the backend reports the broken connection) instead
of hanging. After a failed transfer the group's state is unknown: discard it.

The group is torch.distributed's default one, a group of it, or a `PairGroup`: a two-rank group
of its own built over a store (`pair_group`), so that an instance can pair with several peers
without a process-wide default group.

    sender = KVSender(kv_caches, peer=1, timeout_s=30)
    sent_bytes = sender.send("req-1", [5, 1, 6])              # or begin / send_layer / end
    receiver = KVReceiver(kv_caches, peer=0, timeout_s=30)
    header = receiver.recv([0, 3, 7], request_id="req-1")     # or begin / recv_layer / end
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

MAX_REQUEST_ID_BYTES = 256
_MAGIC = 0x70686B76  # "phkv"
_FIXED = 7  # magic, layers, blocks, block_size, heads, head_dim, dtype
_ID_WORDS = MAX_REQUEST_ID_BYTES // 8
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
           torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)
_ACCEPTED, _DONE = 1, 2
_REFUSALS = {-1: "the request id is not the one the receiver expects",
             -2: "the block count differs from the receiver's",
             -3: "the KV cache layout (layers, block shape or dtype) differs from the "
                 "receiver's",
             -4: "the header is not a photon KV transfer header"}


class KVTransferError(RuntimeError):
    """A transfer failed: refused by the peer, or the connection broke."""


class KVTransferTimeout(KVTransferError):
    """The peer did not answer within timeout_s (dead or stuck)."""


@dataclass(frozen=True)
class PairGroup:
    """A two-rank process group outside torch.distributed's world (its ranks are 0 and 1)."""

    pg: Any
    backend: str  # "gloo" or "nccl"

    def close(self) -> None:
        """Drop the connection (after a failed transfer its state is unknown)."""
        try:
            if self.backend == "nccl":
                self.pg.abort()
            else:
                self.pg.shutdown()
        except RuntimeError:
            pass  # already broken


def pair_group(store: dist.Store, rank: int, device: torch.device, timeout_s: float
               ) -> PairGroup:
    """Join the two-rank group that meets under `store` as `rank` (NCCL for CUDA caches, gloo
    otherwise); waits at most timeout_s for the other rank."""
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return PairGroup(dist.ProcessGroupNCCL(store, rank, 2, opts), "nccl")
    return PairGroup(dist.ProcessGroupGloo(store, rank, 2, timeout), "gloo")


@dataclass(frozen=True)
class TransferHeader:
    request_id: str
    num_layers: int
    num_blocks: int
    block_shape: tuple[int, int, int]  # block_size, num_kv_heads, head_dim
    dtype: torch.dtype


class _End:
    """What both ends share: the caches, the peer, the bounded waits, the layer cursor."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], peer: int,
                 group: dist.ProcessGroup | PairGroup | None, timeout_s: float) -> None:
        self.kv_caches = _check_caches(kv_caches)
        self.device = self.kv_caches[0].device
        self.peer = peer
        self.group = group
        self.timeout_s = timeout_s
        self.header: TransferHeader | None = None
        self.blocks: torch.Tensor | None = None
        self.next_layer = 0
        self.bytes = 0

    def layout(self, request_id: str, num_blocks: int) -> TransferHeader:
        kv = self.kv_caches[0]
        return TransferHeader(request_id, len(self.kv_caches), num_blocks,
                              (kv.shape[2], kv.shape[3], kv.shape[4]), kv.dtype)

    def _start(self, block_ids: Sequence[int]) -> None:
        if self.header is not None:
            raise RuntimeError("a transfer is already in progress on this end")
        self.blocks = _block_index(block_ids, self.kv_caches[0].shape[1], self.device)
        self.next_layer = 0
        self.bytes = 0

    def _layer(self, layer: int) -> torch.Tensor:
        if self.header is None or self.blocks is None:
            raise RuntimeError("begin() the transfer first")
        if layer != self.next_layer:
            raise ValueError(f"layers go in order: expected layer {self.next_layer}, got {layer}")
        self.next_layer += 1
        return self.kv_caches[layer]

    def _finish(self) -> None:
        if self.header is None or self.next_layer != self.header.num_layers:
            done = 0 if self.header is None else self.next_layer
            raise RuntimeError(f"end() after {done} of {len(self.kv_caches)} layers")
        self.header = None
        self.blocks = None

    def _send_tensor(self, tensor: torch.Tensor, what: str) -> None:
        g = self.group
        work = g.pg.send([tensor], self.peer, 0) if isinstance(g, PairGroup) \
            else dist.isend(tensor, self.peer, group=g)
        self.wait(work, what)

    def _recv_tensor(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        g = self.group
        work = g.pg.recv([tensor], self.peer, 0) if isinstance(g, PairGroup) \
            else dist.irecv(tensor, self.peer, group=g)
        self.wait(work, what)
        return tensor

    def status(self, code: int, what: str) -> None:
        self._send_tensor(torch.tensor([code], dtype=torch.int64, device=self.device), what)

    def recv_status(self, what: str) -> int:
        word = torch.zeros(1, dtype=torch.int64, device=self.device)
        return int(self._recv_tensor(word, what)[0])

    def wait(self, work: Any, what: str) -> None:
        """Wait for `work` at most timeout_s: gloo's wait takes the deadline; NCCL's wait()
        only orders streams, so its completion is polled from the host."""
        try:
            g = self.group
            backend = g.backend if isinstance(g, PairGroup) else dist.get_backend(g)
            if backend == "nccl":
                self._poll(work, what)
            else:
                work.wait(timedelta(seconds=self.timeout_s))
        except KVTransferError:
            raise
        except RuntimeError as e:
            kind = KVTransferTimeout if "timed out" in str(e).lower() else KVTransferError
            raise kind(f"{what} with rank {self.peer} failed: {e}") from e

    def _poll(self, work: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        delay = 1e-4
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise KVTransferTimeout(f"{what}: rank {self.peer} did not answer within "
                                        f"{self.timeout_s}s (dead or stuck); discard this "
                                        f"process group")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        work.wait()


class KVSender(_End):
    """The producer's end: sends its blocks' K/V to rank `peer`."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], peer: int,
                 group: dist.ProcessGroup | PairGroup | None = None,
                 timeout_s: float = 30.0) -> None:
        super().__init__(kv_caches, peer, group, timeout_s)

    def begin(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Send the header; raises KVTransferError if the receiver refuses it."""
        self._start(block_ids)
        assert self.blocks is not None
        header = self.layout(request_id, len(self.blocks))
        self._send_tensor(_encode(header, self.device), f"sending the header of "
                                                         f"{request_id!r}")
        code = self.recv_status(f"waiting for the receiver to accept {request_id!r}")
        if code != _ACCEPTED:
            raise KVTransferError(f"rank {self.peer} refused the KV of {request_id!r}: "
                                  f"{_REFUSALS.get(code, f'status {code}')}")
        self.header = header

    def send_layer(self, layer: int) -> None:
        """Send one layer's K/V of the blocks (layers in order, 0 first)."""
        kv = self._layer(layer)
        data = kv.index_select(1, self.blocks)  # [2, n, block_size, heads, dim], contiguous
        self._send_tensor(data, f"sending layer {layer}")
        self.bytes += data.numel() * data.element_size()

    def end(self) -> int:
        """Wait until the receiver has stored every layer; returns the bytes sent."""
        assert self.header is not None, "begin() the transfer first"
        what = f"waiting for the receiver to store {self.header.request_id!r}"
        self._finish()
        if self.recv_status(what) != _DONE:
            raise KVTransferError(f"{what}: unexpected status")
        return self.bytes

    def send(self, request_id: str, block_ids: Sequence[int]) -> int:
        """The whole transfer: begin, every layer, end; returns the bytes sent."""
        self.begin(request_id, block_ids)
        for layer in range(len(self.kv_caches)):
            self.send_layer(layer)
        return self.end()


class KVReceiver(_End):
    """The consumer's end: stores rank `peer`'s blocks' K/V into its own blocks."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], peer: int,
                 group: dist.ProcessGroup | PairGroup | None = None,
                 timeout_s: float = 30.0) -> None:
        super().__init__(kv_caches, peer, group, timeout_s)

    def begin(self, block_ids: Sequence[int], request_id: str | None = None) -> TransferHeader:
        """Receive and check the header (against `request_id` if given and against this end's
        blocks and layout); refuses (and raises KVTransferError) on a mismatch."""
        self._start(block_ids)
        assert self.blocks is not None
        words = torch.zeros(_FIXED + _ID_WORDS, dtype=torch.int64, device=self.device)
        header = _decode(self._recv_tensor(words, "waiting for a header"))
        code = _refusal(header, self.layout(request_id or "", len(self.blocks)),
                        request_id is not None)
        self.status(code or _ACCEPTED, "answering the header")
        if code:
            self.blocks = None
            raise KVTransferError(f"refused the KV from rank {self.peer}: {_REFUSALS[code]}")
        assert header is not None
        self.header = header
        return header

    def recv_layer(self, layer: int) -> None:
        """Receive one layer's K/V into this end's blocks (layers in order, 0 first)."""
        kv = self._layer(layer)
        assert self.blocks is not None
        data = torch.empty((2, len(self.blocks), *kv.shape[2:]), dtype=kv.dtype,
                           device=self.device)
        self._recv_tensor(data, f"receiving layer {layer}")
        kv.index_copy_(1, self.blocks, data)
        self.bytes += data.numel() * data.element_size()

    def end(self) -> int:
        """Tell the sender every layer is stored; returns the bytes received."""
        self._finish()
        self.status(_DONE, "acknowledging the transfer")
        return self.bytes

    def recv(self, block_ids: Sequence[int], request_id: str | None = None) -> TransferHeader:
        """The whole transfer: begin, every layer, end."""
        header = self.begin(block_ids, request_id)
        for layer in range(len(self.kv_caches)):
            self.recv_layer(layer)
        self.end()
        return header


def _check_caches(kv_caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    caches = list(kv_caches)
    if not caches:
        raise ValueError("kv_caches is empty: give one tensor per layer")
    first = caches[0]
    for i, kv in enumerate(caches):
        if kv.dim() != 5 or kv.shape[0] != 2:
            raise ValueError(f"kv_caches[{i}] has shape {tuple(kv.shape)}; expected [2, "
                             f"num_blocks, block_size, num_kv_heads, head_dim]")
        if kv.shape != first.shape or kv.dtype != first.dtype or kv.device != first.device:
            raise ValueError(f"kv_caches[{i}] differs from kv_caches[0] in shape, dtype or "
                             f"device")
    if first.dtype not in _DTYPES:
        raise ValueError(f"KV cache dtype {first.dtype} is not one of {_DTYPES}")
    return caches


def _block_index(block_ids: Sequence[int], num_blocks: int, device: torch.device
                 ) -> torch.Tensor:
    ids = list(block_ids)
    if not ids:
        raise ValueError("block_ids is empty: a transfer moves at least one block")
    bad = [b for b in ids if not isinstance(b, int) or not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids must be integers in [0, {num_blocks}), got {bad[:5]}")
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _encode(h: TransferHeader, device: torch.device) -> torch.Tensor:
    raw = h.request_id.encode()
    if len(raw) > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"the request id is {len(raw)} bytes; at most {MAX_REQUEST_ID_BYTES}")
    padded = raw.ljust(MAX_REQUEST_ID_BYTES, b"\0")
    words = [_MAGIC, h.num_layers, h.num_blocks, *h.block_shape, _DTYPES.index(h.dtype)]
    words += [int.from_bytes(padded[i:i + 8], "little", signed=True)
              for i in range(0, MAX_REQUEST_ID_BYTES, 8)]
    return torch.tensor(words, dtype=torch.int64, device=device)


def _decode(words: torch.Tensor) -> TransferHeader | None:
    w = words.tolist()
    if w[0] != _MAGIC or not 0 <= w[6] < len(_DTYPES):
        return None
    raw = b"".join(int(x).to_bytes(8, "little", signed=True) for x in w[_FIXED:])
    return TransferHeader(raw.rstrip(b"\0").decode(errors="replace"), w[1], w[2],
                          (w[3], w[4], w[5]), _DTYPES[w[6]])


def _refusal(got: TransferHeader | None, mine: TransferHeader, check_id: bool) -> int:
    """0 if the receiver takes `got`, else the refusal code."""
    if got is None:
        return -4
    if check_id and got.request_id != mine.request_id:
        return -1
    if got.num_blocks != mine.num_blocks:
        return -2
    if (got.num_layers, got.block_shape, got.dtype) != \
            (mine.num_layers, mine.block_shape, mine.dtype):
        return -3
    return 0
