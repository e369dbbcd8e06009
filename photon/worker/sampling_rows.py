"""Per-request sampling constants, packed once, and their per-pool-row mirror.

`pack_sampling_row` turns a request's SamplingParams into the int64 / float32 values the sampler
reads (top_k capped at the vocabulary, min_tokens at the resolved max_tokens) when the request is
added: a value that cannot be packed fails that request at the edge, and staging a step only
copies numbers that already fit. `RowState` mirrors, per token-pool row, what staging needs every
step: the block table, those constants and how far the pool holds tokens; both staging paths
(`inputs.build_step_arrays`, `decode_inputs.build_decode_arrays`) gather from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from photon.sampling_params import SamplingParams

if TYPE_CHECKING:
    from photon.engine.request import Request
    from photon.engine.scheduler import ScheduledRow

I64 = np.int64
# Integer sampling constants per row.
TOP_K, KEY, PROMPT_LEN, MIN_TOKENS, LOGPROBS, GREEDY, PENALTIES, GRAMMAR, BIAS = range(9)
_NO_BIAS = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
FLOATS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition")
# A row whose request could not be staged runs once more as a zombie: greedy, nothing else.
_INERT_FLOATS = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)


@dataclass(frozen=True)
class SamplingRow:
    ints: np.ndarray  # [9] int64, columns TOP_K .. BIAS (BIAS: the number of logit_bias entries)
    floats: np.ndarray  # [6] float32, in FLOATS order
    bias_tokens: np.ndarray | None = None  # [B] int64 logit_bias token ids (None: no bias)
    bias_values: np.ndarray | None = None  # [B] float32 their biases


def pack_sampling_row(params: SamplingParams, random_key: int, prompt_len: int, max_tokens: int,
                      vocab_size: int) -> SamplingRow:
    """`random_key`: the counter-based RNG key (`sampler.derive_key`). Raises (OverflowError,
    ValueError) only for values SamplingParams let through (changed after it was validated): the
    caller fails the request."""
    ints = np.array([min(params.top_k, vocab_size),  # a larger top_k keeps every token too
                     random_key, prompt_len,
                     min(params.min_tokens, max_tokens),  # bans end by max_tokens anyway
                     -1 if params.logprobs is None else params.logprobs, int(params.greedy),
                     int(params.needs_penalties), int(params.structured_outputs is not None),
                     len(params.logit_bias or ())], dtype=I64)
    floats = np.array(params.float_row, dtype=np.float32)
    if not np.isfinite(floats).all():
        raise ValueError(f"sampling values {params.float_row} do not fit float32")
    if not params.logit_bias:
        return SamplingRow(ints, floats)
    bias = params.logit_bias
    tokens = np.fromiter(bias.keys(), dtype=I64, count=len(bias))
    values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
    if (tokens >= vocab_size).any() or not np.isfinite(values).all():
        raise ValueError(f"logit_bias {bias} does not fit the vocabulary or float32")
    return SamplingRow(ints, floats, tokens, values)


@dataclass
class SampledConstants:
    ints: dict[str, np.ndarray]  # top_k, keys, prompt_lens
    floats: dict[str, np.ndarray]  # FLOATS
    flags: dict[str, bool | int]  # the sampler's switches (sampling_flags)
    below_min_tokens: list[int]  # sampling rows still under their min_tokens
    biased: list[int]  # sampling rows with a logit_bias


class RowState:
    def __init__(self, num_rows: int, max_blocks: int) -> None:
        self.block_tables = np.zeros((num_rows, max_blocks), dtype=I64)
        self.num_blocks = np.zeros(num_rows, dtype=I64)
        self.pool_valid = np.zeros(num_rows, dtype=I64)  # pool holds tokens [0, pool_valid)
        self.ints = np.zeros((num_rows, BIAS + 1), dtype=I64)
        self.floats = np.zeros((num_rows, len(FLOATS)), dtype=np.float32)

    def assign(self, row: int, req: Request) -> None:
        self.num_blocks[row] = 0
        self.pool_valid[row] = 0
        self.ints[row] = req.sampling.ints
        self.floats[row] = req.sampling.floats

    def assign_inert(self, row: int, prompt_len: int) -> None:
        """Constants for a request that failed to stage: greedy, no penalties, bans or logprobs."""
        self.num_blocks[row] = 0
        self.pool_valid[row] = 0
        self.ints[row] = (0, 0, prompt_len, 0, -1, 1, 0, 0, 0)
        self.floats[row] = _INERT_FLOATS

    def gather(self, pool_rows: np.ndarray, counters: np.ndarray) -> SampledConstants:
        """The constants of a step's sampling rows (`pool_rows`, sampling order) whose next
        output has index `counters`."""
        ints, floats = self.ints[pool_rows], self.floats[pool_rows]
        return SampledConstants(
            ints={"top_k": ints[:, TOP_K], "keys": ints[:, KEY], "prompt_lens": ints[:, PROMPT_LEN]},
            floats={name: floats[:, i] for i, name in enumerate(FLOATS)},
            flags=sampling_flags(ints, floats),
            below_min_tokens=np.flatnonzero(counters < ints[:, MIN_TOKENS]).tolist(),
            biased=np.flatnonzero(ints[:, BIAS]).tolist())

    def sync_blocks(self, rows: list[ScheduledRow]) -> None:
        """Copy blocks added since the last step (block lists only grow while a row is held)."""
        have = self.num_blocks
        for r in rows:
            pr = r.request.pool_row
            n = len(r.block_ids)
            if n > have[pr]:
                self.block_tables[pr, have[pr]:n] = r.block_ids[have[pr]:n]
                have[pr] = n


def sampling_flags(ints: np.ndarray, floats: np.ndarray) -> dict[str, bool | int]:
    """The step's sampler switches from the gathered constants of its sampling rows."""
    random_rows = ints[:, GREEDY] == 0
    return {
        "all_greedy": not bool(random_rows.any()),
        "any_top_k": bool((random_rows & (ints[:, TOP_K] > 0)).any()),
        "any_top_p": bool((random_rows & (floats[:, 1] < 1.0)).any()),
        "any_min_p": bool((random_rows & (floats[:, 2] > 0.0)).any()),
        "any_penalties": bool(ints[:, PENALTIES].any()),
        "max_logprobs": int(ints[:, LOGPROBS].max(initial=-1)),
        "any_grammar": bool(ints[:, GRAMMAR].any()),
        "any_logit_bias": bool(ints[:, BIAS].any()),
    }


def logit_bias_arrays(rows: list[ScheduledRow], biased: list[int]
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat (row, token, bias) triples of the sampling rows `biased` (indices into `rows`, the
    step's sampling rows): the sampler adds them to the logits with one scatter."""
    if not biased:
        return _NO_BIAS[0], _NO_BIAS[0], _NO_BIAS[1]
    samplings = [rows[i].request.sampling for i in biased]
    counts = [len(s.bias_tokens) for s in samplings]
    row_ids = np.repeat(np.asarray(biased, dtype=I64), counts)
    return (row_ids, np.concatenate([s.bias_tokens for s in samplings]),
            np.concatenate([s.bias_values for s in samplings]))
