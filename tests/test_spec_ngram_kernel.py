"""The n-gram proposal kernel (photon.kernels.ngram) against the torch path of propose_ngram.

Without CUDA it runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1); on CUDA
propose_ngram picks the kernel by itself.
"""

from __future__ import annotations

import pytest
import torch

from photon.spec.ngram import propose_ngram
from photon.spec.proposer import ProposeContext
from tests.test_kernels import CUDA, DEVICE
from tests.test_kernels import pytestmark as kernel_marks

pytestmark = kernel_marks


def planted_pool(rows: int, pool_len: int, vocab: int, seed: int) -> torch.Tensor:
    """[rows + 3, pool_len] int32 random tokens, each row with copies of an earlier span of
    itself planted later (so long matches exist), and garbage everywhere."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, vocab, (rows + 3, pool_len), generator=gen, dtype=torch.int32)
    for r in range(rows + 3):
        for _ in range(3):
            n = int(torch.randint(1, 9, (1,), generator=gen))
            src = int(torch.randint(0, pool_len - n, (1,), generator=gen))
            dst = int(torch.randint(src, pool_len - n + 1, (1,), generator=gen))
            pool[r, dst:dst + n] = pool[r, src:src + n].clone()
    return pool


def context(pool: torch.Tensor, rows: int, k: int, seed: int) -> ProposeContext:
    """Shuffled pool rows; lengths 0, 1, 2, short ones and up to the whole row."""
    gen = torch.Generator().manual_seed(seed + 1)
    pool_len = pool.shape[1]
    order = torch.randperm(pool.shape[0], generator=gen)[:rows]
    lens = torch.randint(0, pool_len + 1, (rows,), generator=gen)
    lens[:4] = torch.tensor([0, 1, 2, pool_len])[:rows]
    return ProposeContext(pool.to(DEVICE), order.to(DEVICE), lens.to(DEVICE), k)


def both(ctx: ProposeContext, *args: object) -> None:
    fused = propose_ngram(ctx, *args, fused=True)
    ref = propose_ngram(ctx, *args, fused=False)
    assert fused.draft_ids.dtype == ref.draft_ids.dtype == torch.int64
    assert fused.num_draft.dtype == ref.num_draft.dtype == torch.int32
    assert torch.equal(fused.num_draft.cpu(), ref.num_draft.cpu())
    assert torch.equal(fused.draft_ids.cpu(), ref.draft_ids.cpu())


# Every n-gram range and every K, not the full product (interpreter time).
@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 1), (1, 4, 3), (2, 3, 5), (3, 5, 1),
                                           (5, 5, 3)])
def test_kernel_matches_torch_on_planted_repeats(min_n: int, max_n: int, k: int) -> None:
    seed = min_n * 100 + max_n * 10 + k
    pool = planted_pool(24, 70, 4, seed)
    ctx = context(pool, 24, k, seed)
    for window in (None, 1, 2, 9, 33, 500):
        for max_model_len in (10**6, 40, 3):
            both(ctx, min_n, max_n, max_model_len, window)


def test_kernel_on_long_rows_spanning_several_blocks() -> None:
    pool = planted_pool(6, 600, 3, 7)
    for k in (2, 4):
        ctx = context(pool, 6, k, 8)
        both(ctx, 2, 5, 10**6, None)
        both(ctx, 1, 3, 550, 300)


def test_kernel_on_no_rows() -> None:
    pool = planted_pool(1, 16, 3, 9).to(DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    out = propose_ngram(ProposeContext(pool, none, none, 3), 1, 2, 100, fused=True)
    assert out.draft_ids.shape == (0, 3) and out.num_draft.shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_picks_the_kernel_without_a_sync() -> None:
    pool = planted_pool(32, 256, 5, 11).cuda()
    ctx = context(pool, 32, 4, 12)
    ref = propose_ngram(ctx, 2, 4, 10**6, None, fused=False)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = propose_ngram(ctx, 2, 4, 10**6)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.draft_ids, ref.draft_ids) and torch.equal(out.num_draft, ref.num_draft)
