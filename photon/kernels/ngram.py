"""The n-gram (prompt lookup) proposer in one kernel: photon.spec.ngram.propose_ngram's contract.

One program per row reads its tokens straight from the token pool. It walks the candidate end
positions p of the row's search window (the last W known tokens) in blocks: per block, at most
prompt_lookup_max shifted compares give each p's suffix match length (capped at max_n), and a
running per-lane maximum of length * (L + 1) + p keeps the longest match, then the most recent
end: the torch path's choice (its score orders candidates the same way). Then the up to K tokens
after the chosen end, cut at the known tokens and max_model_len, are copied out. No host sync;
the grid is the row count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _match_length(pool_row, pos, lo, seq_len, num_shifts, BLOCK: tl.constexpr):
    """[BLOCK] the suffix match length ending at each candidate end `pos` in [lo, seq_len - 2]
    (0 elsewhere), capped at num_shifts: the i < num_shifts with t[pos - j] == t[seq_len - 1 - j]
    for every j <= i, both inside the window [lo, seq_len). (pos - i >= lo >= 0 implies the
    suffix token seq_len - 1 - i > pos - i is known too.)"""
    run = (pos >= lo) & (pos <= seq_len - 2)
    length = tl.zeros([BLOCK], dtype=tl.int64)
    for i in range(0, num_shifts):
        src = pos - i
        ok = run & (src >= lo)
        tok = tl.load(pool_row + tl.where(ok, src, 0), mask=ok, other=0)
        want = tl.load(pool_row + tl.maximum(seq_len - 1 - i, 0))
        run = ok & (tok == want)
        length += run.to(tl.int64)
    return length


@triton.jit(do_not_specialize_on_alignment=["rows_ptr", "lens_ptr", "num_ptr"])
def _ngram_kernel(pool_ptr, pool_stride, rows_ptr, lens_ptr, draft_ptr, num_ptr, min_n,
                  num_shifts, width, max_model_len, K, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pool_row = pool_ptr + tl.load(rows_ptr + b).to(tl.int64) * pool_stride
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    lo = tl.maximum(seq_len - width, 0)
    scale = pool_stride + 1  # > any position: the length decides first, then the position
    best = tl.full([BLOCK], -1, tl.int64)
    # A candidate ends at p <= seq_len - 2 (something follows it), inside the window.
    for start in range(lo, seq_len - 1, BLOCK):
        pos = start + tl.arange(0, BLOCK).to(tl.int64)
        length = _match_length(pool_row, pos, lo, seq_len, num_shifts, BLOCK)
        eligible = length >= min_n
        best = tl.maximum(best, tl.where(eligible, length * scale + pos, -1))
    top = tl.max(best, axis=0)
    end = tl.where(top >= 0, top % scale, 0)
    room = tl.maximum(max_model_len - seq_len, 0)
    num = tl.minimum(tl.minimum(seq_len - 1 - end, room), K)
    num = tl.where(top >= 0, num, 0)
    for j in range(0, K):
        tok = tl.load(pool_row + end + 1 + j, mask=j < num, other=0).to(tl.int64)
        tl.store(draft_ptr + b * K + j, tok)
    tl.store(num_ptr + b, num.to(tl.int32))


def propose(token_pool: torch.Tensor, pool_rows: torch.Tensor, seq_lens: torch.Tensor, k: int,
            min_n: int, max_n: int, max_model_len: int, width: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft_ids [B, K] int64, num_draft [B] int32) of photon.spec.ngram.propose_ngram; `width`
    is its search window (<= the pool's row length)."""
    rows = pool_rows.shape[0]
    device = token_pool.device
    draft = torch.empty((rows, k), dtype=torch.int64, device=device)
    num = torch.empty(rows, dtype=torch.int32, device=device)
    if rows == 0:
        return draft, num
    assert token_pool.stride(1) == 1, "the token pool's rows are contiguous"
    _ngram_kernel[(rows,)](token_pool, token_pool.stride(0), pool_rows, seq_lens, draft, num,
                           min_n, min(max_n, width), width, max_model_len, k, BLOCK=128)
    return draft, num
