"""Host-side preparation of one step: scheduled rows -> flat numpy arrays for staging.

Runs on the CPU while the previous step's forward runs on the GPU, so it must never touch a device
tensor. Token ids are not staged for decode rows: their input token is already in the device token
pool (written by the previous step's sampler); only tokens the pool lacks (prompt chunks, recompute
after preemption, a new pool row) are written from the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from photon.engine.scheduler import ScheduledRow
from photon.worker.sampling_rows import I64, RowState, logit_bias_arrays


@dataclass(frozen=True)
class PromptSpan:
    """Prompt tokens [first, first + count) of row `row` are scored this step (their logprobs
    come from the logits of the positions before them), with `k` top logprobs each."""

    row: int
    first: int
    count: int
    k: int


@dataclass
class StepArrays:
    ints: dict[str, np.ndarray]
    floats: dict[str, np.ndarray]
    seq_lens_host: list[int]
    query_lens_host: list[int]
    decode_only: bool
    sample_rows: list[int]  # indices of rows that sample, in sampling order
    flags: dict[str, bool | int]
    prompt_spans: list[PromptSpan] = field(default_factory=list)  # in plp_idx order

    @property
    def prompt_k(self) -> int:
        """The most top logprobs a prompt span wants; -1: no prompt logprobs this step."""
        return max((s.k for s in self.prompt_spans), default=-1)


def _token_arrays(rows: list[ScheduledRow], block_size: int, pool_width: int,
                  pool_valid: np.ndarray) -> dict[str, np.ndarray]:
    """Per-token arrays. Decode rows (one token) take a scalar path: this runs for every row of
    every step, so it avoids per-row numpy calls."""
    positions: list[int] = []
    pool_idx: list[int] = []
    slots: list[int] = []
    write_idx: list[int] = []
    write_ids: list[int] = []
    bs = block_size
    for row in rows:
        req = row.request
        base = req.pool_row * pool_width
        start, end = row.start, row.seq_len
        if end - start == 1:
            positions.append(start)
            pool_idx.append(base + start)
            slots.append(row.block_ids[start // bs] * bs + start % bs)
        else:
            pos = np.arange(start, end, dtype=I64)
            blocks = np.asarray(row.block_ids, dtype=I64)
            positions.extend(pos.tolist())
            pool_idx.extend((base + pos).tolist())
            slots.extend((blocks[pos // bs] * bs + pos % bs).tolist())
        first = pool_valid[req.pool_row]
        if first < end:  # tokens the pool lacks come from the host (committed tokens)
            toks = req.all_token_ids[first:end]
            assert len(toks) == end - first, "an uncommitted token is missing from the pool"
            write_idx.extend(range(base + first, base + end))
            write_ids.extend(toks)
        pool_valid[req.pool_row] = end + int(row.sample)
    arr = _i64
    return {"positions": arr(positions), "pool_idx": arr(pool_idx), "slot_mapping": arr(slots),
            "write_idx": arr(write_idx), "write_ids": arr(write_ids)}


def _i64(values: list[int]) -> np.ndarray:
    return np.fromiter(values, dtype=I64, count=len(values))


def _seq_arrays(rows: list[ScheduledRow]) -> dict[str, np.ndarray]:
    qlens = _i64([r.num_tokens for r in rows])
    qsl = np.zeros(len(rows) + 1, dtype=I64)
    np.cumsum(qlens, out=qsl[1:])
    width = max(len(r.block_ids) for r in rows)
    tables = np.zeros((len(rows), width), dtype=I64)
    for i, r in enumerate(rows):
        tables[i, : len(r.block_ids)] = r.block_ids
    sample = [i for i, r in enumerate(rows) if r.sample]
    return {"seq_lens": _i64([r.seq_len for r in rows]), "query_start_loc": qsl,
            "block_tables": tables, "logits_indices": qsl[1:][sample] - 1}


def _sampling_arrays(rows: list[ScheduledRow], pool_width: int, state: RowState
                     ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, bool | int]]:
    """The sampling rows' constants come from `state` (packed when each request was added), so
    no request's values are converted here."""
    srows = [r for r in rows if r.sample]
    pr = _i64([r.request.pool_row for r in srows])
    seq_lens = _i64([r.seq_len for r in srows])
    counters = _i64([r.out_index for r in srows])
    const = state.gather(pr, counters)
    ints = {**const.ints, "counters": counters, "pool_rows": pr, "s_seq_lens": seq_lens,
            "sample_pool_idx": pr * pool_width + seq_lens}
    ints["ban_rows"], ints["ban_tokens"] = min_tokens_bans(srows, const.below_min_tokens)
    ints["bias_rows"], ints["bias_tokens"], bias_values = logit_bias_arrays(srows, const.biased)
    return ints, {**const.floats, "bias_values": bias_values}, const.flags


def min_tokens_bans(rows: list[ScheduledRow], below: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(row, token) pairs to ban for the rows still under their min_tokens: EOS (unless
    ignore_eos) and the stop ids. Grammar rows are exempt: their grammar decides where the output
    may end, and banning EOS there could leave no legal token at all."""
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    for i in below:
        req = rows[i].request
        p = req.params
        if p.structured_outputs is not None:
            continue
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
        ban_rows.extend([i] * len(banned))
        ban_tokens.extend(sorted(banned))
    return _i64(ban_rows), _i64(ban_tokens)


def prompt_logprob_arrays(rows: list[ScheduledRow], query_start: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray, list[PromptSpan]]:
    """(hidden-state index, prompt token) of every prompt token scored this step, and the spans.
    Rows of requests that asked for prompt logprobs score the prompt tokens following their
    computed positions (the first prompt token has no logprob)."""
    idx: list[int] = []
    tokens: list[int] = []
    spans: list[PromptSpan] = []
    for i, row in enumerate(rows):
        req = row.request
        k = req.params.prompt_logprobs
        end = min(row.seq_len, req.num_prompt_tokens - 1)
        if k is None or row.start >= end or req.prompt_logprobs_done:
            continue
        count = end - row.start
        base = int(query_start[i])
        idx.extend(range(base, base + count))
        tokens.extend(req.prompt_token_ids[row.start + 1:end + 1])
        spans.append(PromptSpan(i, row.start + 1, count, k))
    return _i64(idx), _i64(tokens), spans


def build_step_arrays(rows: list[ScheduledRow], block_size: int, pool_width: int,
                      pool_valid: np.ndarray, state: RowState) -> StepArrays:
    """`pool_valid` is updated for the rows (the runner passes `state.pool_valid`)."""
    ints = _token_arrays(rows, block_size, pool_width, pool_valid)
    ints.update(_seq_arrays(rows))
    s_ints, s_floats, flags = _sampling_arrays(rows, pool_width, state)
    ints.update(s_ints)
    ints["plp_idx"], ints["plp_tokens"], spans = prompt_logprob_arrays(
        rows, ints["query_start_loc"])
    return StepArrays(
        ints=ints,
        floats=s_floats,
        seq_lens_host=[r.seq_len for r in rows],
        query_lens_host=[r.num_tokens for r in rows],
        decode_only=all(r.num_tokens == 1 for r in rows),
        sample_rows=[i for i, r in enumerate(rows) if r.sample],
        flags=flags,
        prompt_spans=spans,
    )
