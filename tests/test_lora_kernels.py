"""The grouped shrink/expand LoRA kernels (photon.kernels.lora) against the torch path.

Without CUDA they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch

from photon.kernels.lora import (
    BLOCK_M,
    LARGE_BATCH,
    LARGE_BLOCK_M,
    block_m_for,
    lora_expand,
    lora_meta,
    lora_shrink,
    num_blocks,
)
from photon.lora.layers import lora_delta_torch
from tests.test_kernels import DEVICE
from tests.test_kernels import pytestmark as kernel_marks

pytestmark = kernel_marks


@pytest.mark.parametrize("num_tokens,rank,k,n,block_m", [
    (1, 16, 40, 24, BLOCK_M), (37, 48, 64, 72, BLOCK_M), (5, 8, 32, 33, BLOCK_M),
    (19, 80, 600, 40, BLOCK_M), (37, 48, 64, 72, LARGE_BLOCK_M), (150, 16, 40, 24, LARGE_BLOCK_M)])
def test_shrink_expand_match_torch(num_tokens: int, rank: int, k: int, n: int,
                                   block_m: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    slots = 4
    a = torch.randn(slots, rank, k, generator=gen)
    b = torch.randn(slots, n, rank, generator=gen)
    a[0], b[0] = 0, 0  # slot 0: the base model
    x = torch.randn(num_tokens, k, generator=gen)
    token_slots = torch.randint(0, slots, (num_tokens,), generator=gen)
    token_slots[0] = 2  # at least one adapted token
    base = torch.randn(num_tokens, n, generator=gen)
    want = base + lora_delta_torch(x, a, b, token_slots)
    dev = [t.to(DEVICE) for t in (x, a, b, token_slots, base)]
    x_d, a_d, b_d, s_d, out = dev
    meta = lora_meta(s_d, slots, block_m)
    lora_expand(lora_shrink(x_d, a_d, meta), b_d, meta, out)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-3)
    # base-model tokens are untouched, bit for bit
    base_rows = (token_slots == 0).nonzero().flatten()
    assert torch.equal(out.cpu()[base_rows], base[base_rows])


def test_meta_groups_tokens_by_slot() -> None:
    token_slots = torch.tensor([2, 0, 2, 1, 0, 2])
    meta = lora_meta(token_slots, 4)
    assert meta.order.tolist() == [1, 4, 3, 0, 2, 5]
    assert meta.counts.tolist() == [2, 1, 3, 0]
    assert meta.starts.tolist() == [0, 2, 3, 6]


def test_meta_cuts_each_adapted_slot_into_blocks() -> None:
    """Blocks of BLOCK_M tokens of one slot; slot 0 (the base model) gets none; the grid's
    spare blocks carry slot S (no block)."""
    token_slots = torch.tensor([3] * (BLOCK_M + 1) + [0] * 5 + [1] * 2)
    meta = lora_meta(token_slots, 4)
    want_slots = [1, 3, 3] + [4] * (num_blocks(token_slots.shape[0], 4) - 3)
    assert meta.block_slot.tolist() == want_slots
    assert meta.block_pos.tolist()[:3] == [5, 7, 7 + BLOCK_M]


def test_prompt_sized_batches_cut_larger_blocks() -> None:
    """From LARGE_BATCH tokens on, blocks of LARGE_BLOCK_M tokens: fewer reads of each slot's
    weights per token."""
    assert block_m_for(LARGE_BATCH - 1) == BLOCK_M and block_m_for(LARGE_BATCH) == LARGE_BLOCK_M
    token_slots = torch.tensor([1] * 70 + [2] * (LARGE_BATCH - 70))
    meta = lora_meta(token_slots, 3)
    assert meta.block_m == LARGE_BLOCK_M
    assert meta.block_pos.tolist()[:3] == [0, 64, 70]  # slot 1: 64 + 6 tokens, then slot 2
    assert meta.block_slot.tolist()[:3] == [1, 1, 2]


def test_kv_sizing_leaves_room_for_every_layers_shrink_output() -> None:
    """The GPU's KV budget keeps back the largest float32 shrink output of a full token budget
    (photon.worker.kv_sizing.lora_headroom), whichever adapted linear it is."""
    from photon import LLM
    from photon.kernels.lora import SPLIT_K
    from photon.worker.kv_sizing import lora_headroom

    llm = LLM("photon-tiny", device="cpu", enable_lora=True, max_lora_rank=32,
              max_num_batched_tokens=512)
    try:
        tokens = llm.config.scheduler.max_num_batched_tokens
        layers = llm.engine.runner.lora.model.layers.values()
        need = max(-(-lin.a.shape[2] // SPLIT_K) * lin.a.shape[1] * tokens * 4 for lin in layers)
        assert 0 < need <= lora_headroom(llm.config)
    finally:
        llm.engine.shutdown()
