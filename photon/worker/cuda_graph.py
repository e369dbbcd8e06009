"""CUDA graphs for decode-only steps at padded batch sizes (one memory pool for all graphs).

A graph is keyed by (padded batch size, block-table width). Its inputs live in static buffers
at fixed addresses; launch() stages a padded step into the slot as usual, then `run()` copies the
slot's device views into the static buffers on the compute stream and replays. Padding rows read
pool entry 0, write their K/V into the reserved null block 0, and attend over one position.
Backends whose decode cost depends on the block-table width (the torch reference gathers whole
tables) get one graph per width bucket; the others declare a single full width.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from photon.attention.backend import AttentionBackend, AttentionMetadata, ForwardContext
from photon.core.inputs import StepInputs


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


def width_buckets(max_blocks: int, backend: AttentionBackend) -> list[int]:
    if not getattr(backend, "decode_cost_depends_on_width", True):
        return [max_blocks]
    widths, w = [], 8
    while w < max_blocks:
        widths.append(w)
        w *= 2
    return widths + [max_blocks]


@dataclass
class _Static:
    pool_idx: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: dict[int, torch.Tensor]  # width -> [max_batch, width] int32


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 kv_caches: list[torch.Tensor], token_pool: torch.Tensor, max_batch: int,
                 max_blocks: int, device: torch.device) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.token_pool = token_pool
        self.batches = batch_buckets(max_batch)
        self.widths = width_buckets(max_blocks, backend)
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.static = _Static(
            pool_idx=torch.zeros(max_batch, **i64), positions=torch.zeros(max_batch, **i64),
            slot_mapping=torch.zeros(max_batch, **i64), seq_lens=torch.ones(max_batch, **i32),
            query_start_loc=torch.arange(max_batch + 1, **i32),
            block_tables={w: torch.zeros(max_batch, w, **i32) for w in self.widths})
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0

    def bucket(self, num_rows: int, width: int) -> tuple[int, int] | None:
        if num_rows > self.batches[-1] or width > self.widths[-1]:
            return None
        return (self.batches[bisect.bisect_left(self.batches, num_rows)],
                self.widths[bisect.bisect_left(self.widths, width)])

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        s = self.static
        meta = AttentionMetadata(
            slot_mapping=s.slot_mapping[:batch], block_tables=s.block_tables[width][:batch],
            seq_lens=s.seq_lens[:batch], query_start_loc=s.query_start_loc[:batch + 1],
            seq_lens_host=[1] * batch, query_lens_host=[1] * batch, decode_only=True)
        input_ids = self.token_pool.view(-1)[s.pool_idx[:batch]].long()
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        return self.model(input_ids, s.positions[:batch], ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first so that smaller graphs reuse the pool's memory."""
        torch.cuda.synchronize()
        for width in reversed(self.widths):
            for batch in reversed(self.batches):
                self._forward(batch, width)  # warm-up outside the graph (lazy inits, autotune)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._forward(batch, width)
                self.pool = graph.pool() if self.pool is None else self.pool
                self.graphs[(batch, width)] = (graph, out)
        torch.cuda.synchronize()

    def run(self, key: tuple[int, int], dev: StepInputs[torch.Tensor], num_rows: int
            ) -> torch.Tensor:
        batch, width = key
        s = self.static
        s.pool_idx[:batch].copy_(dev.pool_idx)
        s.positions[:batch].copy_(dev.positions)
        s.slot_mapping[:batch].copy_(dev.slot_mapping)
        s.seq_lens[:batch].copy_(dev.seq_lens)
        s.block_tables[width][:batch].copy_(dev.block_tables.view(batch, width))
        graph, out = self.graphs[key]
        graph.replay()
        self.replays += 1
        return out[:num_rows]


def pad_decode_inputs(inputs: StepInputs[np.ndarray], num_rows: int, batch: int, width: int
                      ) -> None:
    """Pad a decode step's host arrays in place to the graph's batch and block-table width."""
    pad = np.zeros(batch - num_rows, dtype=np.int64)
    inputs.positions = np.concatenate([inputs.positions, pad])
    inputs.pool_idx = np.concatenate([inputs.pool_idx, pad])
    inputs.slot_mapping = np.concatenate([inputs.slot_mapping, pad])
    inputs.seq_lens = np.concatenate([inputs.seq_lens, pad + 1])
    tables = np.zeros((batch, width), dtype=np.int64)
    old = inputs.block_tables
    tables[: old.shape[0], : old.shape[1]] = old
    inputs.block_tables = tables
