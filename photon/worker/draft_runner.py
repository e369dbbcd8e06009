"""The draft model of speculative method draft_model: its weights and its paged KV cache.

Invariant: the draft's KV tensors are indexed by the target's block ids (same number of blocks,
same block size), so the target's allocator, block tables and block lifetimes (allocation,
shrink, preemption, release of zombie rows) serve both caches; the draft has no allocator.

Per step, on the device and without a host sync:
- `catch_up`: the draft runs the target's forward inputs (the same rows, tokens, positions and
  KV slots: prompt chunks, plain rows and the K + 1 positions of speculative rows), so its KV
  holds every position the target has computed; steps with speculation off skip it, and
  `fill` computes the positions they skipped before the next step that runs it
  (photon.worker.draft_lag);
- after verification, `DraftDecode` is the proposer's `DraftStep` (photon.spec.draft_model): K
  single-token steps (with CUDA graphs all K in one graph, photon.worker.draft_graphs) from
  each proposing request's last known token, writing their KV into the blocks the step's block
  table gives the request. The scheduler reserves K positions past what
  a row's target forward writes for them (its `draft_lookahead`); positions outside the table or
  past max_model_len go to the null block 0, and their drafts are never proposed.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from photon.attention.backend import AttentionBackend, AttentionMetadata, ForwardContext
from photon.config import ModelConfig
from photon.core.inputs import StepInputs
from photon.model.loader import load_model
from photon.spec.draft_model import DraftStep, greedy_steps
from photon.worker.draft_graphs import DraftGraphs
from photon.worker.draft_lag import FillChunk
from photon.worker.piecewise_graphs import PiecewiseGraphs


def kv_block_bytes(mc: ModelConfig, block_size: int, dtype: torch.dtype | None = None) -> int:
    """Bytes of one KV block of model `mc` (K and V of every layer) in `dtype` (default: the
    model's)."""
    elem = torch.tensor([], dtype=dtype or mc.dtype).element_size()
    return 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * elem


class DraftRunner:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, num_rows: int,
                 max_model_len: int, backend: AttentionBackend, device: torch.device) -> None:
        self.config = config
        self.model = load_model(config, str(device))
        shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=config.dtype, device=device)
                          for _ in range(config.num_layers)]
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.backend = backend
        # The step row of each request index in the step being sampled (for its block table).
        self._row_of = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.graphs: DraftGraphs | None = None
        # The catch-up of steps the target runs piecewise (the target's buckets: same size).
        self.piecewise: PiecewiseGraphs | None = None

    def capture_graphs(self, max_batch: int, max_blocks: int, k: int) -> None:
        """Capture the draft's `k` decode steps of a proposal (CUDA only; call before any step
        is in flight)."""
        self.graphs = DraftGraphs(self, max_batch, max_blocks, k, self.kv_caches[0].device)
        self.graphs.capture()

    def capture_piecewise(self, max_tokens: int) -> None:
        """Piecewise graphs for the catch-up, of the target's `max_tokens` (CUDA only)."""
        if PiecewiseGraphs.supports(self.model):
            self.piecewise = PiecewiseGraphs(self.model.model, self.kv_caches, self.backend,
                                             None, max_tokens, self.kv_caches[0].device)
            self.piecewise.capture()

    def catch_up(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                 bucket: int = 0) -> None:
        """The draft's forward over the target's step inputs: only its KV writes matter.
        `bucket`: the target's piecewise bucket the inputs are padded to (0: op by op)."""
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        if bucket and self.piecewise is not None:
            self.piecewise.run(bucket, input_ids, positions, ctx)
        else:
            self.model(input_ids, positions, ctx)

    def fill(self, chunks: list[FillChunk], token_pool: Tensor) -> None:
        """The draft's forward over positions skipped while speculation was off (photon.worker.
        draft_lag), eagerly, before the step's own catch-up; its KV writes are what matter."""
        for c in chunks:
            t = {name: _to_device(getattr(c, name), token_pool.device)
                 for name in ("pool_idx", "positions", "slot_mapping", "seq_lens", "query_lens",
                              "block_tables")}
            starts = torch.zeros(len(c.seq_lens) + 1, dtype=torch.int32, device=token_pool.device)
            starts[1:] = t["query_lens"].cumsum(0)
            meta = AttentionMetadata(
                slot_mapping=t["slot_mapping"], block_tables=t["block_tables"].to(torch.int32),
                seq_lens=t["seq_lens"].to(torch.int32), query_start_loc=starts,
                seq_lens_host=c.seq_lens.tolist(), query_lens_host=c.query_lens.tolist(),
                decode_only=False)
            ids = token_pool.view(-1)[t["pool_idx"]].long()
            self.model(ids, t["positions"], ForwardContext(meta, self.kv_caches, self.backend))

    def decode(self, dev: StepInputs[Tensor], num_rows: int, num_proposing: int) -> DraftStep:
        """The draft step of a sampled step's proposing requests (`dev.propose_reqs`, of which
        the host knows there are `num_proposing`); `num_rows`: the staged rows (a graph's
        padding rows included: the rows of `dev.block_tables`)."""
        # A sampling row's logits index lies in its step row's query span.
        step_row = torch.searchsorted(dev.query_start_loc[1:num_rows + 1], dev.logits_indices,
                                      right=True)
        self._row_of[dev.pool_rows] = step_row
        tables = dev.block_tables.view(num_rows, -1)[self._row_of[dev.propose_reqs]]
        batch = (None if self.graphs is None
                 else self.graphs.bucket(num_proposing, tables.shape[1]))
        if batch is not None:
            return self.graphs.bind(tables, batch)
        return DraftDecode(self, tables, num_proposing)


def _to_device(array: np.ndarray, device: torch.device) -> Tensor:
    """A host array on the device without a host wait (pinned, non-blocking on CUDA)."""
    t = torch.from_numpy(array)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class DraftDecode:
    """photon.spec.draft_model.DraftStep for one step's proposing requests: row b's KV blocks
    are tables[b] (the step's block table of its request)."""

    def __init__(self, draft: DraftRunner, tables: Tensor, num_rows: int) -> None:
        self.draft = draft
        self.tables = tables
        self.tables_i32 = tables.to(torch.int32)
        self.num_rows = num_rows
        self._starts = torch.arange(num_rows + 1, dtype=torch.int32, device=tables.device)

    def greedy(self, input_ids: Tensor, positions: Tensor, k: int) -> Tensor:
        return greedy_steps(self, input_ids, positions, k)

    def __call__(self, input_ids: Tensor, positions: Tensor, step: int) -> Tensor:
        """One decode step: the logits [B, V] of input_ids at positions."""
        d = self.draft
        bs, width = d.block_size, self.tables.shape[1]
        index = positions // bs
        block = self.tables.gather(1, index.clamp(max=width - 1)[:, None])[:, 0]
        inside = (index < width) & (positions < d.max_model_len)
        slots = torch.where(inside, block, torch.zeros_like(block)) * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=self.tables_i32,
            seq_lens=(positions + 1).clamp(max=d.max_model_len).to(torch.int32),
            query_start_loc=self._starts, seq_lens_host=[d.max_model_len] * self.num_rows,
            query_lens_host=[1] * self.num_rows, decode_only=True, seq_lens_exact=False)
        ctx = ForwardContext(meta, d.kv_caches, d.backend)
        hidden = d.model(input_ids, positions.clamp(max=d.max_model_len - 1), ctx)
        return d.model.compute_logits(hidden)
