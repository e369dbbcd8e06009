"""Vectorized host preparation for decode-only steps (the steady state of serving).

`RowState` mirrors, per token-pool row, what staging needs every step: the block table, the
sampling constants and how far the pool holds tokens. It is written once per request (when its
pool row is assigned) and when its block list grows, so a decode step gathers its arrays with a
handful of numpy operations instead of per-row Python work. The result is the same StepArrays the
general path (`inputs.build_step_arrays`) produces; the tests run both.
"""

from __future__ import annotations

import numpy as np

from photon.engine.request import Request
from photon.engine.scheduler import ScheduledRow
from photon.sampling_params import SamplingParams
from photon.worker.inputs import I64, StepArrays, min_tokens_bans

# Integer sampling constants per pool row.
TOP_K, KEY, PROMPT_LEN, MIN_TOKENS, LOGPROBS, GREEDY, PENALTIES, GRAMMAR = range(8)
_FLOATS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition")


class RowState:
    def __init__(self, num_rows: int, max_blocks: int) -> None:
        self.block_tables = np.zeros((num_rows, max_blocks), dtype=I64)
        self.num_blocks = np.zeros(num_rows, dtype=I64)
        self.pool_valid = np.zeros(num_rows, dtype=I64)  # pool holds tokens [0, pool_valid)
        self.ints = np.zeros((num_rows, 8), dtype=I64)
        self.floats = np.zeros((num_rows, 6), dtype=np.float32)

    def assign(self, row: int, req: Request) -> None:
        p: SamplingParams = req.params
        self.num_blocks[row] = 0
        self.pool_valid[row] = 0
        self.ints[row] = (p.top_k, req.random_key, req.num_prompt_tokens, p.min_tokens,
                          -1 if p.logprobs is None else p.logprobs, int(p.greedy),
                          int(p.needs_penalties), int(p.structured_outputs is not None))
        self.floats[row] = p.float_row

    def sync_blocks(self, rows: list[ScheduledRow]) -> None:
        """Copy blocks added since the last step (block lists only grow while a row is held)."""
        have = self.num_blocks
        for r in rows:
            pr = r.request.pool_row
            n = len(r.block_ids)
            if n > have[pr]:
                self.block_tables[pr, have[pr]:n] = r.block_ids[have[pr]:n]
                have[pr] = n


def _flags(ints: np.ndarray, floats: np.ndarray) -> dict[str, bool | int]:
    random_rows = ints[:, GREEDY] == 0
    return {
        "all_greedy": not bool(random_rows.any()),
        "any_top_k": bool((random_rows & (ints[:, TOP_K] > 0)).any()),
        "any_top_p": bool((random_rows & (floats[:, 1] < 1.0)).any()),
        "any_min_p": bool((random_rows & (floats[:, 2] > 0.0)).any()),
        "any_penalties": bool(ints[:, PENALTIES].any()),
        "max_logprobs": int(ints[:, LOGPROBS].max(initial=-1)),
        "any_grammar": bool(ints[:, GRAMMAR].any()),
    }


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
    ints_pr, floats_pr = state.ints[pr], state.floats[pr]
    below = np.nonzero(counters < ints_pr[:, MIN_TOKENS])[0].tolist()
    ban_rows, ban_tokens = min_tokens_bans(rows, below)
    ints = {
        "positions": start, "pool_idx": pr * pool_width + start, "slot_mapping": slots,
        "write_idx": write_idx, "write_ids": write_ids, "seq_lens": seq_lens,
        "query_start_loc": np.arange(n + 1, dtype=I64), "block_tables": tables,
        "logits_indices": np.arange(n, dtype=I64), "top_k": ints_pr[:, TOP_K],
        "keys": ints_pr[:, KEY], "counters": counters, "pool_rows": pr,
        "prompt_lens": ints_pr[:, PROMPT_LEN], "s_seq_lens": seq_lens,
        "sample_pool_idx": pr * pool_width + seq_lens, "ban_rows": ban_rows,
        "ban_tokens": ban_tokens,
    }
    floats = {name: floats_pr[:, i] for i, name in enumerate(_FLOATS)}
    lens = seq_lens.tolist()
    return StepArrays(ints, floats, lens, [1] * n, True, list(range(n)),
                      _flags(ints_pr, floats_pr))


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
