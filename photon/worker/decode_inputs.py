"""Vectorized host preparation for decode-only steps (the steady state of serving).

A decode step gathers its arrays from `RowState` (per token-pool row: block table, sampling
constants, how far the pool holds tokens; see `sampling_rows`) with a handful of numpy operations
instead of per-row Python work. The result is the same StepArrays the general path
(`inputs.build_step_arrays`) produces; the tests run both.
"""

from __future__ import annotations

import numpy as np

from photon.engine.scheduler import ScheduledRow
from photon.worker.inputs import I64, StepArrays, min_tokens_bans
from photon.worker.sampling_rows import RowState, logit_bias_arrays


def build_decode_arrays(rows: list[ScheduledRow], state: RowState, block_size: int,
                        pool_width: int) -> StepArrays:
    """Every row has one query token and samples (callers check `is_plain_decode` first)."""
    n = len(rows)
    pr = np.fromiter((r.request.pool_row for r in rows), dtype=I64, count=n)
    start = np.fromiter((r.start for r in rows), dtype=I64, count=n)
    counters = np.fromiter((r.out_index for r in rows), dtype=I64, count=n)
    state.sync_blocks(rows)
    seq_lens = start + 1
    write_idx, write_ids = _pool_writes(rows, pr, seq_lens, state, pool_width)
    state.pool_valid[pr] = seq_lens + 1  # the sampler writes token seq_len into the pool
    width = int(((seq_lens + block_size - 1) // block_size).max())
    tables = state.block_tables[pr, :width]
    slots = tables[np.arange(n), start // block_size] * block_size + start % block_size
    const = state.gather(pr, counters)
    ban_rows, ban_tokens = min_tokens_bans(rows, const.below_min_tokens)
    bias_rows, bias_tokens, bias_values = logit_bias_arrays(rows, const.biased)
    ints = {
        "positions": start, "pool_idx": pr * pool_width + start, "slot_mapping": slots,
        "write_idx": write_idx, "write_ids": write_ids, "seq_lens": seq_lens,
        "query_start_loc": np.arange(n + 1, dtype=I64), "block_tables": tables,
        "logits_indices": np.arange(n, dtype=I64), **const.ints, "counters": counters,
        "pool_rows": pr, "s_seq_lens": seq_lens, "sample_pool_idx": pr * pool_width + seq_lens,
        "ban_rows": ban_rows, "ban_tokens": ban_tokens, "bias_rows": bias_rows,
        "bias_tokens": bias_tokens, "plp_idx": _NONE, "plp_tokens": _NONE,
    }
    lens = seq_lens.tolist()
    floats = {**const.floats, "bias_values": bias_values}
    return StepArrays(ints, floats, lens, [1] * n, True, list(range(n)), const.flags)


_NONE = np.zeros(0, dtype=I64)  # a decode row never scores a prompt token


def _pool_writes(rows: list[ScheduledRow], pr: np.ndarray, seq_lens: np.ndarray,
                 state: RowState, pool_width: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens the pool lacks (a fresh pool row whose single prompt token is this step's input)."""
    idx: list[int] = []
    ids: list[int] = []
    for i in np.nonzero(state.pool_valid[pr] < seq_lens)[0].tolist():
        req, row = rows[i].request, int(pr[i])
        first, end = int(state.pool_valid[row]), int(seq_lens[i])
        toks = req.all_token_ids[first:end]
        assert len(toks) == end - first, "an uncommitted token is missing from the pool"
        idx.extend(range(row * pool_width + first, row * pool_width + end))
        ids.extend(toks)
    return np.asarray(idx, dtype=I64), np.asarray(ids, dtype=I64)


def is_plain_decode(rows: list[ScheduledRow]) -> bool:
    return all(r.num_tokens == 1 and r.sample for r in rows)
