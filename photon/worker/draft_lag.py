"""Which positions the draft model's KV cache lacks, and the chunks that fill them.

Speculative method draft_model keeps the draft's KV cache in step with the target's by running
the draft over every step's tokens (`DraftRunner.catch_up`). While the adaptive switch keeps
speculation off, nothing reads that cache, so such steps skip the draft's forward: a step skips
it when it proposes no drafts after sampling (`StepPlan.propose` False: the switch chose K_eff
= 0) and is a plain decode step (one sampled token per row, no speculative row: no prompt chunk,
whose blocks the prefix cache may hand to later requests, and no position only the device
knows). Before the next step that runs the draft, the positions skipped since are filled in one
varlen forward of the draft over them (the chunks below), so the draft's cache again holds every
position the target computed when it proposes.

Invariant (host side, updated in plan order while steps are staged): for each request index r,
the draft's KV holds every position the target has computed, except those from `since[r]` on
when `since[r] >= 0`. Skipped steps only run plain decode rows, whose positions the host knows,
so a row's `start` is exact wherever `since` is set or read.

Prefix caching: a block holding a position decoded in a skipped step is marked (`missing`, by
block id) until a fill covers it; a request's first row checks the blocks of its cached prefix
and lags from the first marked one, so the draft never proposes from a prefix whose KV it lacks
(a next turn holding an answer decoded while the switch was off). Prompt chunks never skip.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from photon.core.step import ScheduledRow
from photon.worker.inputs import row_block_tables, token_arrays
from photon.worker.request_table import RequestTable

I64 = np.int64


@dataclass(frozen=True)
class FillChunk:
    """One varlen forward of the draft over skipped positions: segments of consecutive
    positions [start, end) of one request each (at most one per request)."""

    pool_idx: np.ndarray  # [T] token-pool entries of the query tokens
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] KV slots of the draft's cache (the target's block ids)
    seq_lens: np.ndarray  # [N] each segment's end: the length its attention reads
    query_lens: np.ndarray  # [N]
    block_tables: np.ndarray  # [N, W]


@dataclass(frozen=True)
class _Segment:
    req: int
    start: int
    end: int
    block_ids: list[int]


class DraftLag:
    def __init__(self, num_rows: int, num_blocks: int, block_size: int, pool_width: int,
                 max_tokens: int, table: RequestTable) -> None:
        self.since = np.full(num_rows, -1, dtype=I64)
        self.fresh = np.ones(num_rows, dtype=bool)  # no row of the index seen since its reset
        self.missing = np.zeros(num_blocks, dtype=bool)  # blocks with a skipped position
        self.block_size = block_size
        self.pool_width = pool_width
        self.max_tokens = max_tokens  # query tokens per fill chunk
        self.table = table  # the runner's (block tables synced for plain decode steps)

    def reset(self, req_index: int) -> None:
        """A request index left or entered the table: nothing skipped for it."""
        self.since[req_index] = -1
        self.fresh[req_index] = True

    def step(self, rows: list[ScheduledRow], propose: bool, plain_decode: bool,
             per_row: tuple[np.ndarray, np.ndarray] | None = None
             ) -> tuple[bool, list[FillChunk]]:
        """(whether a step of `rows` skips the draft's catch-up, the chunks to fill before it
        runs it): it skips when it proposes nothing after sampling and is a plain decode step
        (`plain_decode`: one sampled token per row, none speculative). `per_row`: the rows'
        request indices and starts when the caller has them as arrays already."""
        if per_row is None:
            per_row = (np.fromiter((r.req_index for r in rows), dtype=I64, count=len(rows)),
                       np.fromiter((r.start for r in rows), dtype=I64, count=len(rows)))
        req, starts = per_row
        self._check_prefixes(rows, req)
        if not propose and plain_decode:
            self.skip(req, starts)
            return True, []
        return False, self.catch_up(rows, req, starts)

    def _check_prefixes(self, rows: list[ScheduledRow], req: np.ndarray) -> None:
        """A request's first row: lag from the first marked block of its cached prefix."""
        first = np.nonzero(self.fresh[req])[0]
        if first.size == 0:
            return
        self.fresh[req[first]] = False
        for i in first.tolist():
            r = rows[i]
            blocks = r.block_ids[:r.start // self.block_size]
            marked = np.nonzero(self.missing[blocks])[0] if blocks else ()
            if len(marked):
                pos = int(marked[0]) * self.block_size
                since = int(self.since[r.req_index])
                self.since[r.req_index] = pos if since < 0 else min(since, pos)

    def skip(self, req: np.ndarray, starts: np.ndarray) -> None:
        """A plain decode step whose rows (request indices `req`, positions `starts`) skip the
        draft: their blocks are marked."""
        fresh = self.since[req] < 0
        self.since[req[fresh]] = starts[fresh]
        self.missing[self.table.block_tables[req, starts // self.block_size]] = True

    def catch_up(self, rows: list[ScheduledRow], req: np.ndarray,
                 starts: np.ndarray) -> list[FillChunk]:
        """A step whose rows run the draft: the chunks that fill their skipped positions first
        (none in the common case: no row lags)."""
        since = self.since[req]
        lagging = np.nonzero((since >= 0) & (since < starts))[0]
        self.since[req] = -1
        if lagging.size == 0:
            return []
        segments = [_Segment(int(req[i]), int(since[i]), int(starts[i]), rows[i].block_ids)
                    for i in lagging.tolist()]
        bs = self.block_size
        for s in segments:  # filled below, before anything reads them
            self.missing[s.block_ids[s.start // bs:(s.end - 1) // bs + 1]] = False
        return [self._chunk(group) for group in self._groups(segments)]

    def _groups(self, segments: list[_Segment]) -> list[list[_Segment]]:
        """Segments cut to at most max_tokens positions, packed into chunks of at most
        max_tokens query tokens; a request's later piece goes into a later chunk (it attends to
        the earlier piece's KV)."""
        pieces = [_Segment(s.req, a, min(a + self.max_tokens, s.end), s.block_ids)
                  for s in segments for a in range(s.start, s.end, self.max_tokens)]
        groups: list[list[_Segment]] = []
        tokens = 0
        for p in pieces:
            size = p.end - p.start
            if not groups or tokens + size > self.max_tokens or any(
                    q.req == p.req for q in groups[-1]):
                groups.append([])
                tokens = 0
            groups[-1].append(p)
            tokens += size
        return groups

    def _chunk(self, group: list[_Segment]) -> FillChunk:
        """The segments as the rows of a step that samples nothing (the step builder's token
        arrays and block tables; every token is in the pool already)."""
        rows = [ScheduledRow(g.req, g.start, g.end - g.start, False, 0, g.block_ids)
                for g in group]
        positions, pool_idx, slots, _, _ = token_arrays(rows, self.table, self.block_size,
                                                        self.pool_width)
        return FillChunk(pool_idx=pool_idx, positions=positions, slot_mapping=slots,
                         seq_lens=np.array([g.end for g in group], dtype=I64),
                         query_lens=np.array([g.end - g.start for g in group], dtype=I64),
                         block_tables=row_block_tables(rows, self.block_size))
