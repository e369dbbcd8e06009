"""`TPGroup`: one rank's view of the tensor-parallel process group.

The group is built from an explicit TCP rendezvous (`TPGroupSpec`: the address and the port the
store of rank 0 bound at start-up, never a fixed port) and passed to the model and the runner at
construction: no process-wide default group is created, so one process may build several engines
one after the other. Every collective has the group's timeout, so a rank that died or hangs makes
the others fail within it instead of blocking forever.

The expert-parallel group that spans data-parallel engine cores (photon.distributed.dp_experts)
is a `TPGroup` too, joined the same way (its store is bound by the front end).

Two process groups share the store: `device` carries the model's collectives (NCCL on CUDA, gloo
on CPU) and `cpu` (always gloo) carries the step plans as bytes. On CPU they are the same group.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroupSpec:
    """How rank `rank` of `size` joins the group (plain values: sent to spawned workers)."""

    host: str
    port: int
    size: int
    timeout_s: float
    device: str  # "cpu" (gloo) or "cuda" (NCCL for the model's collectives)


def bind_store(host: str, size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port of `host` (its `port` names it to the workers)."""
    return dist.TCPStore(host, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class TPGroup:
    """rank/size and the collectives the parallel layers and the step broadcast use."""

    def __init__(self, rank: int, size: int, device_pg: object | None = None,
                 cpu_pg: object | None = None, store: dist.TCPStore | None = None) -> None:
        self.rank = rank
        self.size = size
        self._device_pg = device_pg
        self._cpu_pg = cpu_pg
        self._store = store  # kept alive: the process groups rendezvous through it

    @classmethod
    def single(cls) -> TPGroup:
        """tp = 1: no process group; the collectives are never called."""
        return cls(0, 1)

    @classmethod
    def join(cls, spec: TPGroupSpec, rank: int, store: dist.TCPStore | None = None) -> TPGroup:
        """Join as `rank` (rank 0 passes the store it bound; the others connect to it)."""
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        if store is None:
            store = dist.TCPStore(spec.host, spec.port, spec.size, False, timeout=timeout)
        cpu_pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, spec.size, timeout)
        device_pg = cpu_pg
        if spec.device == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            device_pg = dist.ProcessGroupNCCL(dist.PrefixStore("dev/", store), rank, spec.size,
                                              opts)
        return cls(rank, spec.size, device_pg, cpu_pg, store)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def local_kv_heads(self, num_kv_heads: int) -> int:
        """KV heads per rank: split, or one replicated head when there are fewer than ranks."""
        return max(1, num_kv_heads // self.size)

    # ---- the model's collectives ------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        if self.size > 1:
            self._device_pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t`, concatenated along `dim` in rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._device_pg.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` [size * n, ...] over the ranks; this rank's rows [rank * n, (rank + 1) * n)
        of the sum."""
        if self.size == 1:
            return t
        t = t.contiguous()
        out = torch.empty((t.shape[0] // self.size, *t.shape[1:]), dtype=t.dtype,
                          device=t.device)
        self._device_pg._reduce_scatter_base(out, t).wait()
        return out

    def max_ints(self, values: list[int]) -> list[int]:
        """Element-wise max of the ranks' `values` (one host all-reduce on the CPU group)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._cpu_pg.allreduce([t], opts).wait()
        return [int(v) for v in t.tolist()]

    def min_int(self, value: int) -> int:
        """The least of the ranks' `value` (e.g. the KV blocks every rank can hold)."""
        return self._reduce_int(value, dist.ReduceOp.MIN)

    def max_int(self, value: int) -> int:
        return self.max_ints([value])[0]

    def _reduce_int(self, value: int, op: dist.ReduceOp) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._cpu_pg.allreduce([t], opts).wait()
        return int(t.item())

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order (over the CPU group: the lengths, then the bytes
        padded to the longest)."""
        length = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.empty_like(length) for _ in range(self.size)]
        self._cpu_pg.allgather([lengths], [length]).wait()
        sizes = [int(n.item()) for n in lengths]
        buf = torch.zeros(max(max(sizes), 1), dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(buf) for _ in range(self.size)]
        self._cpu_pg.allgather([parts], [buf]).wait()
        return [part[:n].numpy().tobytes() for part, n in zip(parts, sizes)]

    # ---- the step broadcast -----------------------------------------------------------------
    def broadcast_bytes(self, data: bytes | None, wait_s: float | None = None) -> bytes:
        """Rank 0 sends `data`, the others receive it (length, then the bytes). `wait_s`: how
        long a receiver waits for the length (an idle engine sends nothing for a while; a dead
        rank 0 still ends the wait at once, as its sockets close); default: the group's
        timeout."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        timeout = None if wait_s is None else datetime.timedelta(seconds=wait_s)
        self._cpu_pg.broadcast(size, 0, timeout).wait()
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        if data is not None:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if buf.numel():
            self._cpu_pg.broadcast(buf, 0).wait()
        return data if data is not None else buf.numpy().tobytes()
