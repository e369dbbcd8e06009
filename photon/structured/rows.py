"""Which rows of a step a grammar job touches, in numpy on the engine thread.

`GrammarRows` (owned by the model runner, like `RowState`) keeps three columns per token-pool row:
the matcher handle of the row's request (-1: no grammar, or a grammar that ended), how many of
its committed outputs were handed to that matcher (or passed its gate), and its gate: the token
after which its grammar starts (-1: none; `RequestGrammar.start_after`, the end of a reasoning
block). A gated row is not filled (its mask allows all) and its tokens reach no matcher; its
sampled tokens are compared with the gate at commit, and the gate opens (-1) on a match, so the
next step's mask is the grammar's first. A step with grammar rows gets a `StepFills`
when its masks are built (`fill`): which sampling rows its grammar job fills, from which matcher.
The same rows, less those finalized meanwhile (zombies), are the matchers that accept the step's
tokens at its commit (`accept`): a row filled for step t samples under that mask, so its token is
the one its matcher must take next. A terminated grammar (its stop token accepted) fills nothing
after; zombie rows neither accept nor fill. The one per-row Python left is reading each grammar
row's `request.finalized` (the scheduler's state) at fill and at accept.

Invariant (checked at every fill): a grammar row's mask is built only once every output before
its `out_index` was handed to its matcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from photon.structured.bitmask import ALLOW_ALL, MaskViews, TokenMask

if TYPE_CHECKING:
    from photon.engine.request import Request
    from photon.engine.scheduler import ScheduledRow

NO_GRAMMAR = -1
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class StepFills:
    rows: np.ndarray  # [F] int64: index j of the sampling row (mask row, token index)
    handles: np.ndarray  # [F] int64: its matcher
    pool_rows: np.ndarray  # [F] int64: its token-pool row
    gated: np.ndarray = field(default_factory=lambda: _EMPTY)  # [G] int64: sampling rows whose
    # grammar waits for its gate
    gated_pool_rows: np.ndarray = field(default_factory=lambda: _EMPTY)  # [G]: their pool rows


class GrammarRows:
    def __init__(self, num_rows: int, stop_token_ids: frozenset[int], mask_words: int) -> None:
        self.handle = np.full(num_rows, NO_GRAMMAR, dtype=np.int64)
        self.sent = np.zeros(num_rows, dtype=np.int64)
        self.gate = np.full(num_rows, NO_GRAMMAR, dtype=np.int64)
        self.stops = np.array(sorted(stop_token_ids), dtype=np.int64)
        self.views = MaskViews(mask_words)  # a step's masks over the host and device buffers

    def assign(self, pool_row: int, req: Request) -> None:
        """A request takes the pool row: every output it committed so far reached its matcher
        (a preempted request comes back with nothing in flight)."""
        grammar = req.grammar
        assert grammar is None or grammar.handle is not None, "grammar row scheduled before ready"
        self.handle[pool_row] = NO_GRAMMAR if grammar is None else grammar.handle
        self.sent[pool_row] = len(req.output_token_ids)
        gate = None if grammar is None else grammar.start_after
        self.gate[pool_row] = NO_GRAMMAR if gate is None else gate

    def fill(self, srows: list[ScheduledRow], pool_rows: np.ndarray, counters: np.ndarray,
             mask: TokenMask) -> StepFills:
        """The rows of a step's `mask` (host, one per sampling row `srows[j]`) its grammar job
        fills; every other row gets all bits and the tail set (no constraint), a filled row's
        tail is 0 (ids past the backend's words are not allowed)."""
        handles = self.handle[pool_rows]
        cand = np.flatnonzero(handles >= 0)
        rows = cand[_live(cand, srows)]
        assert np.array_equal(self.sent[pool_rows[rows]], counters[rows]), \
            "grammar mask built before the previous token was committed"
        gated = self.gate[pool_rows[rows]] >= 0
        if gated.any():
            rows, gated_rows = rows[~gated], rows[gated]
        else:
            gated_rows = _EMPTY
        fills = StepFills(rows, handles[rows], pool_rows[rows], gated_rows,
                          pool_rows[gated_rows])
        bits, tail = mask.host_arrays()
        tail.fill(ALLOW_ALL)
        if rows.size < len(srows):
            free = np.ones(len(srows), dtype=bool)
            free[rows] = False
            bits[free] = ALLOW_ALL
        tail[rows] = 0
        return fills

    def accept(self, fills: StepFills, srows: list[ScheduledRow], tokens: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        """(handles, tokens) that the matchers accept at the step's commit: `tokens[j]` is
        sampling row j's token. A stop token ends its grammar here (a matcher accepts one only
        where its grammar may end, and is terminated exactly then), so the scheduler finishes
        the request in this commit without waiting for the accept."""
        if fills.gated.size:
            self._pass_gates(fills, srows, tokens)
        if not fills.rows.size:
            return _EMPTY, _EMPTY
        live = _live(fills.rows, srows)
        rows, pool_rows = fills.rows[live], fills.pool_rows[live]
        toks = tokens[rows]  # fancy indexing copies: the slot's buffer is reused at t+2
        self.sent[pool_rows] += 1
        ended = (toks[:, None] == self.stops).any(axis=1)  # a few stop ids: cheaper than isin
        for k in np.flatnonzero(ended).tolist():
            srows[int(rows[k])].request.grammar.terminated = True
            self.handle[pool_rows[k]] = NO_GRAMMAR
        return fills.handles[live], toks

    def _pass_gates(self, fills: StepFills, srows: list[ScheduledRow], tokens: np.ndarray
                    ) -> None:
        """Gated rows' tokens at commit: counted as passed, and a gate token opens the gate (the
        grammar fills the row's next mask)."""
        live = _live(fills.gated, srows)
        rows, pool_rows = fills.gated[live], fills.gated_pool_rows[live]
        self.sent[pool_rows] += 1
        for k in np.flatnonzero(tokens[rows] == self.gate[pool_rows]).tolist():
            self.gate[pool_rows[k]] = NO_GRAMMAR
            srows[int(rows[k])].request.grammar.start_after = None


def _live(rows: np.ndarray, srows: list[ScheduledRow]) -> np.ndarray:
    """Which of the sampling `rows` belong to requests not finalized (zombies are skipped)."""
    return np.fromiter((not srows[j].request.finalized for j in rows.tolist()), dtype=bool,
                       count=rows.size)
