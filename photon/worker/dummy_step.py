"""The dummy forward of a lockstep engine core with nothing to run (photon.engine.lockstep).

When the MoE experts span the data-parallel cores, every core must run a forward whenever any
core does, so that the MoE layers' collectives pair up. A core without a step of its own runs
one padding token through the model: position 0 of a one-token sequence whose K/V go to the
reserved null block 0 (where padding rows write and which no request reads). The output is
discarded; no request's KV cache, token pool row or sampling state is touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from photon.attention.backend import AttentionMetadata, ForwardContext

if TYPE_CHECKING:
    from photon.worker.model_runner import ModelRunner

_NULL_BLOCK = 0


@torch.inference_mode()
def dummy_forward(runner: ModelRunner) -> None:
    """One padding token through `runner`'s model, its output dropped."""
    device = runner.device
    meta = AttentionMetadata(
        slot_mapping=torch.full((1,), _NULL_BLOCK * runner.block_size, dtype=torch.int64,
                                device=device),
        block_tables=torch.full((1, 1), _NULL_BLOCK, dtype=torch.int32, device=device),
        seq_lens=torch.ones(1, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        seq_lens_host=[1],
        query_lens_host=[1],
        decode_only=True,
    )
    ids = torch.zeros(1, dtype=torch.int64, device=device)
    ctx = ForwardContext(meta, runner.kv_caches, runner.backend, runner.kv_scales)
    runner.model(ids, ids, ctx)  # token 0 at position 0
