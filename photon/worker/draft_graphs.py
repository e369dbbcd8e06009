"""CUDA graphs for the draft model's decode steps (speculative method draft_model).

A proposing step runs K single-token draft steps for its proposing requests; eagerly each is a
whole small model's worth of kernel launches, which at small batch costs more than the target's
captured step. One graph per padded batch size captures the K steps of a proposal (`DraftDecode`
over static buffers: token ids, positions and block tables of the full width; each step's argmax
feeds the next inside the graph): a proposal is one copy of the ids and positions and one
replay.

Padding rows (past the step's proposing requests) hold position 0 and an all-zero block table:
their K/V go to slot 0 of the null block 0 and their logits are never read. `bind` zeroes them
once per step, so stale rows of a larger earlier batch never write into a live request's blocks.

The graphs have their own memory pool: the step graphs' outputs (the target's logits) must not
share memory with a draft step that runs while they may still be read.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from photon.worker.cuda_graph import Captured, batch_buckets

if TYPE_CHECKING:
    from photon.worker.draft_runner import DraftRunner


class DraftGraphs:
    def __init__(self, draft: DraftRunner, max_batch: int, max_blocks: int, k: int,
                 device: torch.device) -> None:
        self.draft = draft
        self.k = k  # the draft steps of every proposal
        self.batches = batch_buckets(max_batch)
        i64 = dict(dtype=torch.int64, device=device)
        self.ids = torch.zeros(max_batch, **i64)
        self.positions = torch.zeros(max_batch, **i64)
        self.tables = torch.zeros(max_batch, max_blocks, **i64)
        self.graphs: dict[int, Captured] = {}
        self.replays = 0

    def bucket(self, num_rows: int, width: int) -> int | None:
        if num_rows > self.batches[-1] or width > self.tables.shape[1]:
            return None
        return self.batches[bisect.bisect_left(self.batches, num_rows)]

    def _forward(self, batch: int) -> Tensor:
        from photon.worker.draft_runner import DraftDecode

        step = DraftDecode(self.draft, self.tables[:batch], batch)
        return step.greedy(self.ids[:batch], self.positions[:batch], self.k)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first so that smaller graphs reuse the pool's memory."""
        torch.cuda.synchronize()
        pool = None
        for batch in reversed(self.batches):
            g = Captured(lambda b=batch: self._forward(b), pool)
            pool = g.pool
            self.graphs[batch] = g
        torch.cuda.synchronize()

    def bind(self, tables: Tensor, batch: int) -> GraphedDraftDecode:
        """A step's draft decode: `tables` [n, width] of its proposing requests, in bucket
        `batch` (from `bucket`)."""
        n, width = tables.shape
        self.tables[:batch].zero_()
        self.tables[:n, :width].copy_(tables)
        self.positions[n:batch].zero_()
        self.ids[n:batch].zero_()
        return GraphedDraftDecode(self, batch, n)


class GraphedDraftDecode:
    """photon.spec.draft_model.DraftStep replaying the captured K draft steps."""

    def __init__(self, graphs: DraftGraphs, batch: int, num_rows: int) -> None:
        self.graphs = graphs
        self.batch = batch
        self.num_rows = num_rows

    def greedy(self, input_ids: Tensor, positions: Tensor, k: int) -> Tensor:
        g = self.graphs
        if k != g.k:
            raise ValueError(f"the draft graphs run {g.k} steps, asked for {k}")
        g.ids[:self.num_rows].copy_(input_ids)
        g.positions[:self.num_rows].copy_(positions)
        out = g.graphs[self.batch].replay()
        g.replays += 1
        return out[:self.num_rows]
