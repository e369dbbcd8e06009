"""photon/kv_transfer/p2p.py on gloo with two CPU processes (the NCCL path's code): the bytes of
every layer arrive equal in the receiver's blocks, a mismatched header is refused on both
ends, and a peer killed mid-transfer raises within the timeout instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from photon.kv_transfer.p2p import KVReceiver, KVSender

LAYERS, BLOCKS, SHAPE = 3, 8, (4, 2, 8)  # block_size, kv heads, head dim
SENT, STORED = [5, 1, 6], [0, 3, 7]


def producer_caches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, BLOCKS, *SHAPE, generator=gen) for _ in range(LAYERS)]


def consumer_caches() -> list[torch.Tensor]:
    return [torch.zeros(2, BLOCKS, *SHAPE) for _ in range(LAYERS)]


def _send(request_id: str) -> Any:
    return KVSender(producer_caches(), peer=1, timeout_s=20).send(request_id, SENT)


def _recv(request_id: str) -> Any:
    caches = consumer_caches()
    header = KVReceiver(caches, peer=0, timeout_s=20).recv(STORED, request_id="req-1")
    # numpy, not tensors: a tensor in a queue is shared memory that dies with this process
    return header.request_id, header.num_blocks, [c.numpy() for c in caches]


def _send_header_then_die(request_id: str) -> Any:
    sender = KVSender(producer_caches(), peer=1, timeout_s=20)
    sender.begin(request_id, SENT)
    os._exit(0)  # killed after the header: no layer follows


def _recv_with_short_timeout(request_id: str) -> Any:
    KVReceiver(consumer_caches(), peer=0, timeout_s=3).recv(STORED, request_id=request_id)


def _rank_main(rank: int, store: str, fn: Callable[[str], Any], request_id: str,
               results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        results.put((rank, "ok", fn(request_id)))
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put((rank, type(e).__name__, str(e)))


def run_pair(tmp_path: Path, sender: Callable[[str], Any], receiver: Callable[[str], Any],
             request_id: str = "req-1", expect: int = 2) -> dict[int, tuple[str, Any]]:
    """Run `sender` on rank 0 and `receiver` on rank 1; the results by rank (bounded waits,
    both processes reaped)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_rank_main, args=(r, store, fn, request_id, results))
             for r, fn in enumerate((sender, receiver))]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in range(expect):
            try:
                rank, kind, value = results.get(timeout=120)
            except queue.Empty:
                pytest.fail(f"only {sorted(out)} of the ranks answered")
            out[rank] = (kind, value)
        return out
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)


def test_blocks_arrive_equal_layer_by_layer(tmp_path: Path) -> None:
    out = run_pair(tmp_path, _send, _recv)
    assert out[0][0] == "ok", out[0]
    assert out[1][0] == "ok", out[1]
    rid, num_blocks, arrays = out[1][1]
    got = [torch.from_numpy(a) for a in arrays]
    assert (rid, num_blocks) == ("req-1", len(SENT))
    sent = producer_caches()
    for layer in range(LAYERS):
        assert torch.equal(got[layer][:, STORED], sent[layer][:, SENT])
        others = [b for b in range(BLOCKS) if b not in STORED]
        assert torch.count_nonzero(got[layer][:, others]) == 0
    per_block = 2 * SHAPE[0] * SHAPE[1] * SHAPE[2] * 4
    assert out[0][1] == LAYERS * len(SENT) * per_block  # bytes sent


def test_wrong_request_is_refused_on_both_ends(tmp_path: Path) -> None:
    out = run_pair(tmp_path, _send, _recv, request_id="req-2")
    assert out[0][0] == "KVTransferError" and "refused" in out[0][1] and "request id" in out[0][1]
    assert out[1][0] == "KVTransferError" and "request id" in out[1][1]


def test_killed_peer_raises_instead_of_hanging(tmp_path: Path) -> None:
    out = run_pair(tmp_path, _send_header_then_die, _recv_with_short_timeout, expect=1)
    kind, message = out[1]
    assert kind in ("KVTransferError", "KVTransferTimeout"), (kind, message)
    assert "rank 0" in message and "layer 0" in message


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="expected \\[2, num_blocks"):
        KVSender([torch.zeros(2, 3)], peer=1)
    with pytest.raises(ValueError, match="block ids must be integers in \\[0, 8\\)"):
        KVSender(producer_caches(), peer=1).begin("r", [8])
    with pytest.raises(ValueError, match="block_ids is empty"):
        KVReceiver(consumer_caches(), peer=0).begin([])
