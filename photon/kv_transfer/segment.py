"""A transfer's file in the machine's shared memory (/dev/shm, else the temp directory): a JSON
header line, then per layer the transfer's blocks, block-major ([n, 2, block_size, heads,
head_dim]) so that any run of blocks is one contiguous read.

Publishing is atomic: the producer writes `<path>.tmp` and renames it. The consumer's ack is
removing the file; the producer's lease ends by removing it too.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable

import torch

_MAGIC = "photon-kv-1"


def segment_dir() -> str:
    """Where transfers live: a RAM-backed directory when the machine has one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def segment_path(directory: str, rendezvous: str, engine_id: str, transfer_id: str,
                 tp_rank: int = 0) -> str:
    """The file of one tensor-parallel rank's shard of a transfer (rank 0's carries no rank)."""
    rank = f".rank{tp_rank}" if tp_rank else ""
    return os.path.join(directory, f"photon-kv-{rendezvous}-{engine_id}-{transfer_id}{rank}")


def peer_alive(engine_id: str) -> bool:
    """An engine id starts with its process id: False once that process is gone."""
    try:
        os.kill(int(engine_id.split("-", 1)[0]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        return True  # another user's live process, or an id without a pid: assume alive
    return True


def write_segment(path: str, layers: list[torch.Tensor], publish: bool = True) -> int:
    """Write the per-layer block tensors ([n, 2, bs, H, D], on the host) and publish them;
    the bytes written. `publish=False` (fault injection) leaves the unpublished `.tmp`."""
    first = layers[0]
    header = {"magic": _MAGIC, "layers": len(layers), "shape": list(first.shape),
              "dtype": str(first.dtype)}
    tmp = path + ".tmp"
    nbytes = 0
    with open(tmp, "wb") as f:
        f.write((json.dumps(header) + "\n").encode())
        for t in layers:
            data = t.contiguous().view(torch.uint8).numpy()
            f.write(data)
            nbytes += data.nbytes
    if publish:
        os.replace(tmp, path)
    return nbytes


def wait_for_segment(path: str, engine_id: str, deadline: float,
                     stopped: Callable[[], bool]) -> None:
    """Until the file exists; TimeoutError past `deadline` (time.monotonic()), ConnectionError
    once the producer's process is gone, InterruptedError once `stopped()` (an abort, or the
    engine shuts down)."""
    while not os.path.exists(path):
        if stopped():
            raise InterruptedError("the load was stopped")
        if not peer_alive(engine_id):
            raise ConnectionError(f"the prefill instance {engine_id} is gone")
        if time.monotonic() > deadline:
            raise TimeoutError("the KV cache did not arrive in time")
        time.sleep(0.002)  # a poll interval on the transfer thread, never the engine loop


def read_blocks(path: str, caches: list[torch.Tensor], first: int, block_ids: list[int]) -> int:
    """Copy the file's blocks [first, first + len(block_ids)) of every layer into `block_ids`
    of `caches` ([2, blocks, bs, H, D] each); the bytes read. ValueError if the file does not
    match the caches' layout."""
    with open(path, "rb") as f:
        header = json.loads(f.readline())
        start = f.tell()
        shape, n = header.get("shape"), len(block_ids)
        want = [2, *caches[0].shape[2:]]
        if (header.get("magic") != _MAGIC or header.get("layers") != len(caches)
                or header.get("dtype") != str(caches[0].dtype) or shape[1:] != want
                or first + n > shape[0]):
            raise ValueError(f"the prefill instance's KV layout {header} does not match this "
                             f"instance ({len(caches)} layers, blocks {want}, {caches[0].dtype})")
        block_bytes = caches[0][:, 0].numel() * caches[0].element_size()
        ids = torch.tensor(block_ids, dtype=torch.long, device=caches[0].device)
        for layer, cache in enumerate(caches):
            f.seek(start + (layer * shape[0] + first) * block_bytes)
            buf = bytearray(n * block_bytes)
            f.readinto(buf)
            src = torch.frombuffer(buf, dtype=cache.dtype).view(n, *want)
            cache[:, ids] = src.transpose(0, 1).to(cache.device)
    return n * block_bytes * len(caches)


def remove(path: str) -> bool:
    """Remove the file; False if it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
