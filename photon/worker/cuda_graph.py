"""CUDA graphs for decode-only steps at padded batch sizes (one memory pool for all graphs).

A graph is keyed by (padded batch size, block-table width). Its inputs live in static buffers
at fixed addresses; launch() stages a padded step into the slot as usual, then `run()` copies the
slot's device views into the static buffers on the compute stream and replays. Padding rows read
pool entry 0, write their K/V into the reserved null block 0, and attend over one position.
Backends whose decode cost depends on the block-table width (the torch reference gathers whole
tables) get one graph per width bucket; the others declare a single full width.

A decode-only step may hold speculative rows verifying no draft (K_eff = 0): the launch resolves
their positions into the slot's views before `run()` copies them. With a draft model, each
graph also runs the draft's forward over the same inputs (its KV catch-up) before the target's;
a second set without it serves steps that skip the catch-up (photon.worker.spec_graphs.LeanKey).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from photon.attention.backend import AttentionBackend, AttentionMetadata, ForwardContext
from photon.attention.kv_quant import KVCacheScales
from photon.core.inputs import StepInputs
from photon.worker.inputs import pad_token_arrays

if TYPE_CHECKING:
    from photon.lora.layers import LoRABatch
    from photon.worker.draft_runner import DraftRunner


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


def staged_rows(dev: StepInputs[torch.Tensor]) -> int:
    """Rows of a staged step, padding rows of a graph included (a shape: no sync). Per-row
    views (block tables, seq_lens) have this many rows."""
    return dev.query_start_loc.shape[0] - 1


@dataclass
class GraphModel:
    """What a captured forward runs: the target (and draft) model over the token pool."""

    model: torch.nn.Module
    backend: AttentionBackend
    kv_caches: list[torch.Tensor]
    token_pool: torch.Tensor
    draft: DraftRunner | None = None
    lora: LoRABatch | None = None  # with --enable-lora: the slot grouping runs in the graph
    kv_scales: KVCacheScales | None = None  # an FP8 cache's (fixed while graphs replay)

    def forward(self, meta: AttentionMetadata, pool_idx: torch.Tensor, positions: torch.Tensor
                ) -> torch.Tensor:
        input_ids = self.token_pool.view(-1)[pool_idx].long()
        if self.lora is not None:
            self.lora.active = True  # graphs always run the LoRA kernels (slot 0 skips)
            self.lora.prepare(pool_idx.shape[0])
        if self.draft is not None:
            self.draft.catch_up(input_ids, positions, meta)
        return self.model(input_ids, positions,
                          ForwardContext(meta, self.kv_caches, self.backend, self.kv_scales))


class Captured:
    """One captured graph and its output tensor (in the shared pool).

    The graph reads and writes the addresses of every tensor `forward` touched. Tensors made
    inside the capture live in the graph's pool; those made outside it (inputs built for the
    capture) must be kept alive by the caller for as long as the graph can replay: freed, their
    memory goes to other tensors and a replay writes into those. `Captured` holds the graph and
    its output only, not `forward`: a closure over a runner would keep a freed engine's memory
    reachable from wherever the graph is.
    """

    def __init__(self, forward: Callable[[], torch.Tensor], pool: tuple | None) -> None:
        forward()  # warm-up outside the graph (lazy inits, Triton compiles and autotune)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = forward()
        self.pool = self.graph.pool() if pool is None else pool

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


@dataclass
class _Static:
    pool_idx: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: dict[int, torch.Tensor]  # width -> [max_batch, width] int32


def static_buffers(num_tokens: int, max_batch: int, widths: list[int], device: torch.device
                   ) -> _Static:
    i64 = dict(dtype=torch.int64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    return _Static(
        pool_idx=torch.zeros(num_tokens, **i64), positions=torch.zeros(num_tokens, **i64),
        slot_mapping=torch.zeros(num_tokens, **i64), seq_lens=torch.ones(max_batch, **i32),
        query_start_loc=torch.arange(max_batch + 1, **i32),
        block_tables={w: torch.zeros(max_batch, w, **i32) for w in widths})


def copy_inputs(s: _Static, dev: StepInputs[torch.Tensor], num_tokens: int, batch: int,
                width: int) -> None:
    """A staged padded step's device views into the static buffers (on the compute stream)."""
    s.pool_idx[:num_tokens].copy_(dev.pool_idx)
    s.positions[:num_tokens].copy_(dev.positions)
    s.slot_mapping[:num_tokens].copy_(dev.slot_mapping)
    s.seq_lens[:batch].copy_(dev.seq_lens)
    s.block_tables[width][:batch].copy_(dev.block_tables.view(batch, width))


class DecodeGraphs:
    def __init__(self, fwd: GraphModel, max_batch: int, max_blocks: int,
                 device: torch.device) -> None:
        self.fwd = fwd
        self.batches = batch_buckets(max_batch)
        self.widths = width_buckets(max_blocks, fwd.backend)
        self.static = static_buffers(max_batch, max_batch, self.widths, device)
        self.graphs: dict[tuple[int, int], Captured] = {}
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
        return self.fwd.forward(meta, s.pool_idx[:batch], s.positions[:batch])

    @torch.inference_mode()
    def capture(self, pool: tuple | None = None) -> tuple | None:
        """Largest first so that smaller graphs reuse the pool's memory; returns the pool."""
        torch.cuda.synchronize()
        for width in reversed(self.widths):
            for batch in reversed(self.batches):
                g = Captured(lambda b=batch, w=width: self._forward(b, w), pool)
                pool = g.pool
                self.graphs[(batch, width)] = g
        torch.cuda.synchronize()
        return pool

    def run(self, key: tuple[int, int], dev: StepInputs[torch.Tensor], num_rows: int
            ) -> torch.Tensor:
        batch, width = key
        copy_inputs(self.static, dev, batch, batch, width)
        out = self.graphs[key].replay()
        self.replays += 1
        return out[:num_rows]


def pad_rows(inputs: StepInputs[np.ndarray], batch: int, width: int, tokens_per_row: int
             ) -> None:
    """Pad a uniform step's host arrays in place to `batch` rows of `tokens_per_row` query
    tokens and a block-table width of `width`. Padding tokens sit at position 0, read pool
    entry 0 and write their K/V into slot 0 of the null block 0; padding rows see
    `tokens_per_row` positions of the null block. Sampling fields are not padded: padding rows
    never sample, and are no speculative rows (the launch never resolves them)."""
    pad_token_arrays(inputs, batch * tokens_per_row - inputs.positions.shape[0])
    rows_pad = np.full(batch - inputs.seq_lens.shape[0], tokens_per_row, dtype=np.int64)
    inputs.seq_lens = np.concatenate([inputs.seq_lens, rows_pad])
    inputs.query_start_loc = np.arange(batch + 1, dtype=np.int64) * tokens_per_row
    tables = np.zeros((batch, width), dtype=np.int64)
    old = inputs.block_tables
    tables[: old.shape[0], : old.shape[1]] = old
    inputs.block_tables = tables

