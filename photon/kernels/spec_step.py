"""Speculative step bookkeeping, each part in a single launch: photon.worker.spec_step.SpecDecoder's
torch code (its CPU path and oracle) fused per row.

- `resolve`: one program per speculative row fills its K_eff + 1 query tokens' positions, pool
  entries and KV slots, its seq_len, and its sampling rows' counters, lengths and pool entries,
  from the device length `dev_len` of its request.
- `gather_drafts`: the drafts each speculative row verifies, from the token pool, and their
  count (verification's inputs).
- `advance`: a step whose sampling rows are all speculative rows' (K_eff + 1 each, in row
  order): the kept tokens into the pool and each request's new device length.
- `write_proposals`: a proposer's drafts into the pool after each request's device length, and
  their count.
Each writes exactly what the torch code writes; grids come from shapes only; no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon.core.inputs import StepInputs


@triton.jit
def _resolve_kernel(dev_len_ptr, rows_ptr, reqs_ptr, vrows_ptr, qsl_ptr, tables_ptr, table_width,
                    positions_ptr, pool_idx_ptr, slot_ptr, seq_lens_ptr, counters_ptr,
                    prompt_lens_ptr, sample_lens_ptr, sample_pool_ptr, k, pool_width,
                    block_size, max_model_len, BLOCK_J: tl.constexpr):
    s = tl.program_id(0)
    row = tl.load(rows_ptr + s)
    req = tl.load(reqs_ptr + s)
    d = tl.load(dev_len_ptr + req)
    j = tl.arange(0, BLOCK_J).to(tl.int64)
    live = j <= k
    pos = d - 1 + j  # d >= 1: a speculative row's last known token is in the pool
    tok = tl.load(qsl_ptr + row) + j
    base = req * pool_width
    tl.store(positions_ptr + tok, tl.minimum(pos, max_model_len - 1), mask=live)
    tl.store(pool_idx_ptr + tok, base + tl.minimum(pos, pool_width - 1), mask=live)
    blk = pos // block_size
    inside = live & (blk < table_width)
    block = tl.load(tables_ptr + row * table_width + tl.where(inside, blk, 0), mask=inside,
                    other=0)
    tl.store(slot_ptr + tok, block * block_size + pos % block_size, mask=live)
    tl.store(seq_lens_ptr + row, d + k)
    v = tl.load(vrows_ptr + s) + j
    nxt = pos + 1  # the position of the token each sampling row decides
    prompt = tl.load(prompt_lens_ptr + v, mask=live, other=0)
    tl.store(counters_ptr + v, nxt - prompt, mask=live)
    tl.store(sample_lens_ptr + v, nxt, mask=live)
    tl.store(sample_pool_ptr + v, base + tl.minimum(nxt, pool_width - 1), mask=live)


def resolve(dev_len: torch.Tensor, dev: StepInputs[torch.Tensor], num_rows: int, k: int,
            pool_width: int, block_size: int, max_model_len: int) -> None:
    """SpecDecoder.resolve's writes into `dev` (its speculative rows non-empty)."""
    num_spec = dev.spec_rows.shape[0]
    _resolve_kernel[(num_spec,)](
        dev_len, dev.spec_rows, dev.spec_reqs, dev.spec_vrows, dev.query_start_loc,
        dev.block_tables, dev.block_tables.shape[0] // num_rows, dev.positions, dev.pool_idx,
        dev.slot_mapping, dev.seq_lens, dev.counters, dev.prompt_lens, dev.sample_seq_lens,
        dev.sample_pool_idx, k, pool_width, block_size, max_model_len,
        BLOCK_J=triton.next_power_of_2(k + 1))


@triton.jit
def _draft_entries(dev_len_ptr, reqs_ptr, b, pool_width, BLOCK_J: tl.constexpr):
    """(request, [BLOCK_J] draft positions j, their pool entries): program b's request and its
    pool row's entries at dev_len + j, clamped to the row (where drafts are read and written)."""
    req = tl.load(reqs_ptr + b)
    j = tl.arange(0, BLOCK_J).to(tl.int64)
    d = tl.load(dev_len_ptr + req)
    return req, j, req * pool_width + tl.minimum(d + j, pool_width - 1)


@triton.jit
def _gather_drafts_kernel(pool_ptr, dev_len_ptr, num_draft_ptr, reqs_ptr, drafts_ptr, num_ptr, k,
                          pool_width, BLOCK_J: tl.constexpr):
    s = tl.program_id(0)
    req, j, entry = _draft_entries(dev_len_ptr, reqs_ptr, s, pool_width, BLOCK_J)
    live = j < k
    tok = tl.load(pool_ptr + entry, mask=live, other=0)
    tl.store(drafts_ptr + s * k + j, tok.to(tl.int64), mask=live)
    tl.store(num_ptr + s, tl.minimum(tl.load(num_draft_ptr + req), k).to(tl.int32))


def gather_drafts(pool: torch.Tensor, dev_len: torch.Tensor, num_draft: torch.Tensor,
                  reqs: torch.Tensor, k: int, pool_width: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [S, k] int64, num_draft [S] int32): request reqs[s]'s pool entries at dev_len ..
    dev_len + k - 1 (clamped to its row) and its proposal count, at most k."""
    rows = reqs.shape[0]
    drafts = torch.empty((rows, k), dtype=torch.int64, device=pool.device)
    num = torch.empty(rows, dtype=torch.int32, device=pool.device)
    if rows:
        _gather_drafts_kernel[(rows,)](pool, dev_len, num_draft, reqs, drafts, num, k,
                                       pool_width, BLOCK_J=triton.next_power_of_2(max(k, 1)))
    return drafts, num


@triton.jit
def _advance_kernel(tokens_ptr, pool_ptr, dev_len_ptr, reqs_ptr, vrows_ptr, sample_pool_ptr,
                    sample_lens_ptr, k, BLOCK_J: tl.constexpr):
    s = tl.program_id(0)
    j = tl.arange(0, BLOCK_J).to(tl.int64)
    v = tl.load(vrows_ptr + s) + j
    live = j <= k
    tok = tl.load(tokens_ptr + v, mask=live, other=-1)
    keep = live & (tok >= 0)
    tl.store(pool_ptr + tl.load(sample_pool_ptr + v, mask=keep, other=0), tok.to(tl.int32),
             mask=keep)
    ends = tl.where(keep, tl.load(sample_lens_ptr + v, mask=keep, other=0) + 1, 0)
    tl.store(dev_len_ptr + tl.load(reqs_ptr + s), tl.max(ends, axis=0).to(tl.int64))


def advance(tokens: torch.Tensor, pool: torch.Tensor, dev_len: torch.Tensor,
            dev: StepInputs[torch.Tensor], k: int) -> None:
    """SpecDecoder.advance for a step whose sampling rows are all speculative rows' (k + 1 each,
    `dev.spec_vrows` their first): kept tokens (>= 0) into the pool at their sampling rows'
    entries, and each request's device length the largest kept position + 1."""
    rows = dev.spec_reqs.shape[0]
    if rows:
        _advance_kernel[(rows,)](tokens, pool, dev_len, dev.spec_reqs, dev.spec_vrows,
                                 dev.sample_pool_idx, dev.sample_seq_lens, k,
                                 BLOCK_J=triton.next_power_of_2(k + 1))


@triton.jit
def _write_proposals_kernel(pool_ptr, dev_len_ptr, num_draft_ptr, reqs_ptr, draft_ptr, num_ptr,
                            k, pool_width, BLOCK_J: tl.constexpr):
    b = tl.program_id(0)
    req, j, entry = _draft_entries(dev_len_ptr, reqs_ptr, b, pool_width, BLOCK_J)
    num = tl.load(num_ptr + b)
    live = j < num
    tok = tl.load(draft_ptr + b * k + j, mask=live, other=0)
    tl.store(pool_ptr + entry, tok.to(tl.int32), mask=live)
    tl.store(num_draft_ptr + req, num.to(tl.int64))


def write_proposals(pool: torch.Tensor, dev_len: torch.Tensor, num_draft: torch.Tensor,
                    reqs: torch.Tensor, draft_ids: torch.Tensor, num: torch.Tensor, k: int,
                    pool_width: int) -> None:
    """Request reqs[b]'s first num[b] drafts (draft_ids [B, k]) into its pool row at dev_len ..
    (clamped to the row), num[b] into num_draft."""
    rows = reqs.shape[0]
    if rows:
        _write_proposals_kernel[(rows,)](pool, dev_len, num_draft, reqs,
                                         draft_ids.contiguous(), num, k, pool_width,
                                         BLOCK_J=triton.next_power_of_2(max(k, 1)))
