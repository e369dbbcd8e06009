"""RequestTable: the runner's state of each request, indexed by its request index.

The index is also the request's row of the device token pool. Per index the table keeps what
staging a step reads: the block table (grown as the plan's block lists grow), how far the pool holds
the request's tokens (`pool_valid`), its packed sampling constants (numpy columns, gathered per step
with a few fancy-indexing operations), its committed tokens at admission (the host writes those the
pool lacks) and how many top prompt logprobs it still wants. Rows enter with the plan's
`new_requests` and leave with its `released`; both staging paths (`inputs.build_step_inputs`,
`decode_inputs.build_decode_inputs`) read the table and never write it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from photon.core.inputs import SamplingFlags
from photon.core.sampling import (
    FLOAT_COLUMNS,
    INERT_FLOATS,
    NUM_INT_COLUMNS,
    IntCol,
    PackedSampling,
)
from photon.core.step import NewRequest, ScheduledRow

I64 = np.int64
_EMPTY_I = np.zeros(0, dtype=I64)
_EMPTY_F = np.zeros(0, dtype=np.float32)
_TOP_P, _MIN_P = (FLOAT_COLUMNS.index(n) for n in ("top_p", "min_p"))


@dataclass(slots=True)
class Gathered:
    """The constants of a step's sampling rows."""

    top_k: np.ndarray
    keys: np.ndarray
    prompt_lens: np.ndarray
    floats: list[np.ndarray]  # FLOAT_COLUMNS order
    flags: SamplingFlags
    below_min_tokens: list[int]  # sampling rows still under their min_tokens
    biased: list[int]  # sampling rows with a logit_bias


class RequestTable:
    def __init__(self, num_rows: int, max_blocks: int) -> None:
        self.num_rows = num_rows
        self.block_tables = np.zeros((num_rows, max_blocks), dtype=I64)
        self.num_blocks = np.zeros(num_rows, dtype=I64)
        self.pool_valid = np.zeros(num_rows, dtype=I64)  # the pool holds tokens [0, pool_valid)
        self.ints = np.zeros((num_rows, NUM_INT_COLUMNS), dtype=I64)
        self.floats = np.zeros((num_rows, len(FLOAT_COLUMNS)), dtype=np.float32)
        self.prompt_k = np.full(num_rows, -1, dtype=I64)
        self.spec = np.zeros(num_rows, dtype=I64)  # K of speculative requests, 0: plain
        self.lora = np.zeros(num_rows, dtype=I64)  # LoRA slot of each request, 0: none
        self.tokens: list[list[int] | None] = [None] * num_rows
        self.sampling: list[PackedSampling | None] = [None] * num_rows

    @property
    def num_live(self) -> int:
        return self.num_rows - self.tokens.count(None)

    def add(self, new: NewRequest) -> None:
        """May raise for values that do not fit (the caller makes the row inert instead)."""
        i = new.req_index
        assert self.tokens[i] is None, f"request index {i} is already in use"
        self.num_blocks[i] = 0
        self.pool_valid[i] = 0
        self.tokens[i] = new.token_ids
        self.sampling[i] = new.sampling
        self.prompt_k[i] = new.prompt_logprobs
        self.spec[i] = new.spec
        self.lora[i] = new.lora_slot
        self.ints[i] = new.sampling.ints
        self.floats[i] = new.sampling.floats

    def add_inert(self, new: NewRequest) -> None:
        """A request whose constants could not be staged: greedy, no penalties, bans, bias or
        logprobs (its row runs once more as a zombie whose token is ignored)."""
        i = new.req_index
        self.num_blocks[i] = 0
        self.pool_valid[i] = 0
        self.ints[i] = 0
        self.ints[i, IntCol.PROMPT_LEN] = new.sampling.ints[IntCol.PROMPT_LEN]
        self.ints[i, IntCol.LOGPROBS] = -1
        self.ints[i, IntCol.GREEDY] = 1
        self.floats[i] = INERT_FLOATS
        self.prompt_k[i] = -1
        self.spec[i] = 0
        self.lora[i] = new.lora_slot  # it holds the slot until it is released
        self.tokens[i] = new.token_ids
        self.sampling[i] = PackedSampling(tuple(self.ints[i].tolist()), INERT_FLOATS)

    def remove(self, i: int) -> None:
        self.tokens[i] = None
        self.sampling[i] = None

    def gather(self, rows: np.ndarray, counters: np.ndarray) -> Gathered:
        """The constants of a step's sampling rows (request indices `rows`, sampling order) whose
        next output has index `counters`."""
        ints, floats = self.ints[rows], self.floats[rows]
        return Gathered(
            top_k=ints[:, IntCol.TOP_K], keys=ints[:, IntCol.KEY],
            prompt_lens=ints[:, IntCol.PROMPT_LEN],
            floats=[floats[:, c] for c in range(len(FLOAT_COLUMNS))],
            flags=sampling_flags(ints, floats),
            below_min_tokens=np.flatnonzero(counters < ints[:, IntCol.MIN_TOKENS]).tolist(),
            biased=np.flatnonzero(ints[:, IntCol.BIAS]).tolist())

    def sync_blocks(self, rows: list[ScheduledRow]) -> None:
        """Copy blocks added since the last step (block lists only grow while a row is held)."""
        have = self.num_blocks
        for r in rows:
            i, n = r.req_index, len(r.block_ids)
            if n > have[i]:
                self.block_tables[i, have[i]:n] = r.block_ids[have[i]:n]
                have[i] = n

    def missing_tokens(self, i: int, end: int) -> tuple[int, list[int]]:
        """(first, tokens): the committed tokens [first, end) the pool lacks for request `i`."""
        first = int(self.pool_valid[i])
        if first >= end:
            return first, []
        toks = self.tokens[i][first:end]
        assert len(toks) == end - first, "an uncommitted token is missing from the pool"
        return first, toks

    def min_tokens_bans(self, rows: np.ndarray, below: list[int]
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sampling row, token, min_tokens) triples to ban for the sampling rows `below`
        (request indices `rows[j]`) whose output index may be under their min_tokens: the
        sampler bans a pair while the row's device counter is below its min_tokens (a
        speculative row's host counter is only a lower bound)."""
        if not below:
            return _EMPTY_I, _EMPTY_I, _EMPTY_I
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        until: list[int] = []
        for j in below:
            i = int(rows[j])
            bans = self.sampling[i].min_tokens_bans
            ban_rows.extend([j] * len(bans))
            ban_tokens.extend(bans)
            until.extend([int(self.ints[i, IntCol.MIN_TOKENS])] * len(bans))
        return (np.asarray(ban_rows, dtype=I64), np.asarray(ban_tokens, dtype=I64),
                np.asarray(until, dtype=I64))

    def logit_bias(self, rows: np.ndarray, biased: list[int]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat (sampling row, token, bias) triples of the sampling rows `biased`: the sampler
        adds them to the logits with one scatter."""
        if not biased:
            return _EMPTY_I, _EMPTY_I, _EMPTY_F
        packed = [self.sampling[int(rows[j])] for j in biased]
        counts = [len(p.bias_tokens) for p in packed]
        return (np.repeat(np.asarray(biased, dtype=I64), counts),
                np.fromiter((t for p in packed for t in p.bias_tokens), dtype=I64,
                            count=sum(counts)),
                np.fromiter((v for p in packed for v in p.bias_values), dtype=np.float32,
                            count=sum(counts)))


def sampling_flags(ints: np.ndarray, floats: np.ndarray) -> SamplingFlags:
    """The step's sampler switches from the gathered constants of its sampling rows."""
    random_rows = ints[:, IntCol.GREEDY] == 0
    return SamplingFlags(
        all_greedy=not bool(random_rows.any()),
        any_top_k=bool((random_rows & (ints[:, IntCol.TOP_K] > 0)).any()),
        any_top_p=bool((random_rows & (floats[:, _TOP_P] < 1.0)).any()),
        any_min_p=bool((random_rows & (floats[:, _MIN_P] > 0.0)).any()),
        any_penalties=bool(ints[:, IntCol.PENALTIES].any()),
        any_logit_bias=bool(ints[:, IntCol.BIAS].any()),
        max_logprobs=int(ints[:, IntCol.LOGPROBS].max(initial=-1)))
