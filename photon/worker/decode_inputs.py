"""Vectorized host preparation for decode-only steps (the steady state of serving) and for
speculative decode steps (every row verifying the same K_eff drafts).

A decode step gathers its inputs from the `RequestTable` (per request index: block table,
sampling constants, how far the pool holds tokens) with a handful of numpy operations instead of
per-row Python work. The result is the same `HostStep` the general path
(`inputs.build_step_inputs`) produces; the tests run both.
"""

from __future__ import annotations

import numpy as np

from photon.core.inputs import StepInputs
from photon.core.step import ScheduledRow
from photon.worker.inputs import HostStep
from photon.worker.request_table import I64, RequestTable

_NONE = np.zeros(0, dtype=I64)  # a decode row never scores a prompt token


def build_decode_inputs(rows: list[ScheduledRow], table: RequestTable, block_size: int,
                        pool_width: int, lookahead: int = 0) -> HostStep:
    """Every row has one query token and samples (callers check `is_plain_decode` first; a
    speculative request's first sampling row may be one: the runner proposes after it).
    `table.sync_blocks(rows)` must have run. `lookahead`: positions past seq_len the block
    tables also cover (a draft model's steps after sampling)."""
    n = len(rows)
    req = np.fromiter((r.req_index for r in rows), dtype=I64, count=n)
    start = np.fromiter((r.start for r in rows), dtype=I64, count=n)
    counters = np.fromiter((r.out_index for r in rows), dtype=I64, count=n)
    seq_lens = start + 1
    write_idx, write_ids = _pool_writes(req, seq_lens, table, pool_width)
    width = int(((seq_lens + lookahead + block_size - 1) // block_size).max())
    tables = table.block_tables[req, :width]
    if lookahead:  # only the blocks each row holds (the null block past them)
        held = np.arange(tables.shape[1])[None, :] < table.num_blocks[req][:, None]
        tables = np.where(held, tables, 0)
    slots = tables[np.arange(n), start // block_size] * block_size + start % block_size
    g = table.gather(req, counters)
    ban_rows, ban_tokens, ban_until = table.min_tokens_bans(req, g.below_min_tokens)
    bias_rows, bias_tokens, bias_values = table.logit_bias(req, g.biased)
    steps = np.arange(n + 1, dtype=I64)
    sample_pool_idx = req * pool_width + seq_lens
    inputs = StepInputs(
        start, req * pool_width + start, slots, write_idx, write_ids, seq_lens, steps, tables,
        steps[:n], g.top_k, g.keys, counters, req, g.prompt_lens, seq_lens, sample_pool_idx,
        ban_rows, ban_tokens, ban_until, bias_rows, bias_tokens, _NONE, _NONE, _NONE, _NONE, _NONE,
        req[table.spec[req] > 0], table.lora[req], *g.floats, bias_values)
    # the sampler writes token seq_len into the pool
    return HostStep(inputs, seq_lens.tolist(), [1] * n, True, list(range(n)), g.flags,
                    (req, seq_lens + 1))


def _pool_writes(req: np.ndarray, seq_lens: np.ndarray, table: RequestTable, pool_width: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Tokens the pool lacks (a new request whose single prompt token is this step's input)."""
    idx: list[int] = []
    ids: list[int] = []
    for i in np.nonzero(table.pool_valid[req] < seq_lens)[0].tolist():
        row, end = int(req[i]), int(seq_lens[i])
        first, toks = table.missing_tokens(row, end)
        idx.extend(range(row * pool_width + first, row * pool_width + end))
        ids.extend(toks)
    return np.asarray(idx, dtype=I64), np.asarray(ids, dtype=I64)


def is_plain_decode(rows: list[ScheduledRow]) -> bool:
    return all(r.num_tokens == 1 and r.sample and not r.speculative for r in rows)


def build_spec_inputs(rows: list[ScheduledRow], table: RequestTable, k: int, pool_width: int,
                      block_size: int) -> HostStep:
    """Every row is a speculative row verifying `k` drafts (`spec_graphs.uniform_spec_k`): k + 1
    query tokens and sampling rows each, every token in the pool, positions resolved on the
    device (placeholders here, as in the general path). Block tables come from the rows' own
    block lists (a speculative row's list may be longer than the table's synced copy)."""
    n, w = len(rows), k + 1
    req = np.fromiter((r.req_index for r in rows), dtype=I64, count=n)
    seq_lens = np.fromiter((r.seq_len for r in rows), dtype=I64, count=n)
    out_index = np.fromiter((r.out_index for r in rows), dtype=I64, count=n)
    width = max(max(len(r.block_ids), -(-r.seq_len // block_size)) for r in rows)
    tables = np.zeros((n, width), dtype=I64)
    for i, r in enumerate(rows):
        tables[i, :len(r.block_ids)] = r.block_ids
    vreq, counters, vlens = (np.repeat(a, w) for a in (req, out_index, seq_lens))
    g = table.gather(vreq, counters)
    ban_rows, ban_tokens, ban_until = table.min_tokens_bans(vreq, g.below_min_tokens)
    bias_rows, bias_tokens, bias_values = table.logit_bias(vreq, g.biased)
    zeros, steps = np.zeros(n * w, dtype=I64), np.arange(n * w, dtype=I64)
    rows_at = np.arange(n, dtype=I64)
    inputs = StepInputs(
        zeros, np.repeat(req * pool_width, w), zeros.copy(), _NONE, _NONE, seq_lens,
        np.arange(n + 1, dtype=I64) * w, tables, steps, g.top_k, g.keys, counters, vreq,
        g.prompt_lens, vlens, vreq * pool_width + vlens, ban_rows, ban_tokens, ban_until,
        bias_rows, bias_tokens, _NONE, _NONE, rows_at, req, rows_at * w,
        req[table.spec[req] > 0], np.repeat(table.lora[req], w), *g.floats, bias_values)
    return HostStep(inputs, seq_lens.tolist(), [w] * n, w == 1, list(range(n)), g.flags,
                    (req, np.full(n, pool_width, dtype=I64)), [], [w] * n, k,
                    uniform_spec=True)
