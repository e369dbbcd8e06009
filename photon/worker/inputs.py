"""Host-side preparation of one step: scheduled rows -> flat numpy arrays for staging.

Runs on the CPU while the previous step's forward runs on the GPU, so it must never touch a device
tensor. Token ids are not staged for decode rows: their input token is already in the device token
pool (written by the previous step's sampler); only tokens the pool lacks (prompt chunks, recompute
after preemption, a new pool row) are written from the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from photon.engine.scheduler import ScheduledRow

I64 = np.int64


@dataclass
class StepArrays:
    ints: dict[str, np.ndarray]
    floats: dict[str, np.ndarray]
    seq_lens_host: list[int]
    query_lens_host: list[int]
    decode_only: bool
    sample_rows: list[int]  # indices of rows that sample, in sampling order
    flags: dict[str, bool | int]


def _token_arrays(rows: list[ScheduledRow], block_size: int, pool_width: int,
                  pool_valid: list[int]) -> dict[str, np.ndarray]:
    positions, pool_idx, slots, write_idx, write_ids = [], [], [], [], []
    for row in rows:
        req = row.request
        pos = np.arange(row.start, row.seq_len, dtype=I64)
        blocks = np.asarray(row.block_ids, dtype=I64)
        base = req.pool_row * pool_width
        positions.append(pos)
        pool_idx.append(base + pos)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        first = pool_valid[req.pool_row]
        if first < row.seq_len:  # tokens the pool lacks come from the host (committed tokens)
            toks = req.all_token_ids[first:row.seq_len]
            assert len(toks) == row.seq_len - first, "an uncommitted token is missing from the pool"
            write_idx.append(base + np.arange(first, row.seq_len, dtype=I64))
            write_ids.append(np.asarray(toks, dtype=I64))
        pool_valid[req.pool_row] = row.seq_len + int(row.sample)
    cat = _concat
    return {"positions": cat(positions), "pool_idx": cat(pool_idx), "slot_mapping": cat(slots),
            "write_idx": cat(write_idx), "write_ids": cat(write_ids)}


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=I64)


def _seq_arrays(rows: list[ScheduledRow]) -> dict[str, np.ndarray]:
    qlens = np.fromiter((r.num_tokens for r in rows), dtype=I64, count=len(rows))
    qsl = np.zeros(len(rows) + 1, dtype=I64)
    np.cumsum(qlens, out=qsl[1:])
    width = max(len(r.block_ids) for r in rows)
    tables = np.zeros((len(rows), width), dtype=I64)
    for i, r in enumerate(rows):
        tables[i, : len(r.block_ids)] = r.block_ids
    seq_lens = np.fromiter((r.seq_len for r in rows), dtype=I64, count=len(rows))
    sample = [i for i, r in enumerate(rows) if r.sample]
    return {"seq_lens": seq_lens, "query_start_loc": qsl, "block_tables": tables,
            "logits_indices": qsl[1:][sample] - 1}


def _sampling_arrays(rows: list[ScheduledRow], pool_width: int
                     ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, bool | int]]:
    ints: dict[str, list[int]] = {k: [] for k in ("top_k", "keys", "counters", "pool_rows",
                                                  "prompt_lens", "s_seq_lens", "sample_pool_idx",
                                                  "ban_rows", "ban_tokens")}
    floats: dict[str, list[float]] = {k: [] for k in ("temperature", "top_p", "min_p", "presence",
                                                      "frequency", "repetition")}
    max_lp = -1
    for r_idx, row in enumerate(r for r in rows if r.sample):
        req, p = row.request, row.request.params
        for key, val in (("top_k", p.top_k), ("keys", req.random_key), ("counters", row.out_index),
                         ("pool_rows", req.pool_row), ("prompt_lens", req.num_prompt_tokens),
                         ("s_seq_lens", row.seq_len),
                         ("sample_pool_idx", req.pool_row * pool_width + row.seq_len)):
            ints[key].append(val)
        for key, val in (("temperature", p.temperature), ("top_p", p.top_p), ("min_p", p.min_p),
                         ("presence", p.presence_penalty), ("frequency", p.frequency_penalty),
                         ("repetition", p.repetition_penalty)):
            floats[key].append(val)
        if row.out_index < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
            ints["ban_rows"].extend([r_idx] * len(banned))
            ints["ban_tokens"].extend(sorted(banned))
        if p.logprobs is not None:
            max_lp = max(max_lp, p.logprobs)
    flags = _flags(rows, max_lp)
    return ({k: np.asarray(v, dtype=I64) for k, v in ints.items()},
            {k: np.asarray(v, dtype=np.float32) for k, v in floats.items()}, flags)


def _flags(rows: list[ScheduledRow], max_lp: int) -> dict[str, bool | int]:
    params = [r.request.params for r in rows if r.sample]
    return {
        "all_greedy": all(p.greedy for p in params),
        "any_top_k": any(p.top_k > 0 and not p.greedy for p in params),
        "any_top_p": any(p.top_p < 1.0 and not p.greedy for p in params),
        "any_min_p": any(p.min_p > 0.0 and not p.greedy for p in params),
        "any_penalties": any(p.needs_penalties for p in params),
        "max_logprobs": max_lp,
    }


def build_step_arrays(rows: list[ScheduledRow], block_size: int, pool_width: int,
                      pool_valid: list[int]) -> StepArrays:
    ints = _token_arrays(rows, block_size, pool_width, pool_valid)
    ints.update(_seq_arrays(rows))
    s_ints, s_floats, flags = _sampling_arrays(rows, pool_width)
    ints.update(s_ints)
    return StepArrays(
        ints=ints,
        floats=s_floats,
        seq_lens_host=[r.seq_len for r in rows],
        query_lens_host=[r.num_tokens for r in rows],
        decode_only=all(r.num_tokens == 1 for r in rows),
        sample_rows=[i for i, r in enumerate(rows) if r.sample],
        flags=flags,
    )
