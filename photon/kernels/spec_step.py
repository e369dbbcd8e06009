"""Speculative step bookkeeping in a single launch: photon.worker.spec_step.SpecDecoder.resolve's
torch code (its CPU path and oracle) fused per row.

One program per speculative row fills its K_eff + 1 query tokens' positions, pool entries and KV
slots, its seq_len, and its sampling rows' counters, lengths and pool entries, from the device
length `dev_len` of its request: exactly what the torch code writes. The grid comes from shapes
only; no host sync.
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
