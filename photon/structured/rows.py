"""Which rows of a step a grammar job touches, in numpy on the engine thread.

`GrammarRows` (owned by the grammar step, photon.structured.step) keeps three columns per request
index: the matcher handle of the request (-1: no grammar, or a grammar that ended), how many of its
committed outputs were handed to that matcher (or passed its gate), and its gate: the token after
which its grammar starts (-1: none, or already passed; `RequestGrammar.start_after`, the end of a
reasoning block). A gated row is not filled (its mask allows all) and its tokens reach no matcher;
its sampled tokens are compared with the gate at commit, and the gate opens (-1) on a match, so the
next step's mask is the grammar's first. A step with grammar rows gets a `StepFills` when its masks
are built (`fill`): which sampling rows its grammar job fills, from which matcher. The same rows,
less those finished meanwhile (zombies), are the matchers that accept the step's tokens at its
commit (`accept`): a row filled for step t samples under that mask, so its token is the one its
matcher must take next. A terminated grammar (its stop token accepted) fills nothing after, and
`accept` returns its request index (the scheduler finishes the request); zombie rows neither accept
nor fill. The one per-row Python left is reading each grammar row's `request.finished` (the
scheduler's state) at fill and at accept.

Invariant (checked at every fill): a grammar row's mask is built only once every output before
its `out_index` was handed to its matcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from photon.structured.bitmask import ALLOW_ALL, MaskViews, TokenMask

if TYPE_CHECKING:
    from collections.abc import Sequence

    from photon.engine.request import Request

NO_GRAMMAR = -1
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class StepFills:
    rows: np.ndarray  # [F] int64: index j of the sampling row (mask row, token index)
    handles: np.ndarray  # [F] int64: its matcher
    req: np.ndarray  # [F] int64: its request index
    gated: np.ndarray = field(default_factory=lambda: _EMPTY)  # [G] int64: sampling rows whose
    # grammar waits for its gate
    gated_req: np.ndarray = field(default_factory=lambda: _EMPTY)  # [G]: their request indices


@dataclass(frozen=True)
class Accepts:
    """A commit's accepts: matcher handles[i] takes tokens[i], for sampling row rows[i]; the
    sampling rows `ended` took their grammar's stop token."""

    handles: np.ndarray
    tokens: np.ndarray
    rows: np.ndarray
    ended: np.ndarray


class GrammarRows:
    def __init__(self, num_rows: int, stop_token_ids: frozenset[int], mask_words: int) -> None:
        self.handle = np.full(num_rows, NO_GRAMMAR, dtype=np.int64)
        self.sent = np.zeros(num_rows, dtype=np.int64)
        self.gate = np.full(num_rows, NO_GRAMMAR, dtype=np.int64)
        self.stops = np.array(sorted(stop_token_ids), dtype=np.int64)
        self.views = MaskViews(mask_words)  # a step's masks over the host and device buffers

    def assign(self, i: int, req: Request) -> None:
        """Request `req` takes index `i`: every output it committed so far reached its matcher
        (a preempted request comes back with nothing in flight), and its gate is open once the
        gate token is among them."""
        grammar = req.grammar
        assert grammar is None or grammar.handle is not None, "grammar row scheduled before ready"
        self.handle[i] = NO_GRAMMAR if grammar is None else grammar.handle
        self.sent[i] = len(req.output_token_ids)
        gate = None if grammar is None else grammar.start_after
        closed = gate is not None and gate not in req.output_token_ids
        self.gate[i] = gate if closed else NO_GRAMMAR

    def fill(self, requests: Sequence[Request], req: np.ndarray, counters: np.ndarray,
             mask: TokenMask) -> StepFills:
        """The rows of a step's `mask` (host, one per sampling row j: `requests[j]` at request
        index `req[j]`) its grammar job fills; every other row gets all bits and the tail set (no
        constraint), a filled row's tail is 0 (ids past the backend's words are not allowed)."""
        handles = self.handle[req]
        cand = np.flatnonzero(handles >= 0)
        rows = cand[_live(cand, requests)]
        assert np.array_equal(self.sent[req[rows]], counters[rows]), \
            "grammar mask built before the previous token was committed"
        gated = self.gate[req[rows]] >= 0
        if gated.any():
            rows, gated_rows = rows[~gated], rows[gated]
        else:
            gated_rows = _EMPTY
        fills = StepFills(rows, handles[rows], req[rows], gated_rows, req[gated_rows])
        bits, tail = mask.host_arrays()
        tail.fill(ALLOW_ALL)
        if rows.size < len(requests):
            free = np.ones(len(requests), dtype=bool)
            free[rows] = False
            bits[free] = ALLOW_ALL
        tail[rows] = 0
        return fills

    def accept(self, fills: StepFills, requests: Sequence[Request], tokens: np.ndarray
               ) -> Accepts:
        """What the matchers accept at the step's commit (`tokens[j]` is sampling row j's
        token). A matcher accepts a stop token only where its grammar may end, and is terminated
        exactly then, so the scheduler finishes the request in this commit without waiting for
        the accept."""
        if fills.gated.size:
            self._pass_gates(fills, requests, tokens)
        if not fills.rows.size:
            return Accepts(_EMPTY, _EMPTY, _EMPTY, _EMPTY)
        live = _live(fills.rows, requests)
        rows, req = fills.rows[live], fills.req[live]
        toks = tokens[rows]  # fancy indexing copies: the slot's buffer is reused at t+2
        self.sent[req] += 1
        ended = (toks[:, None] == self.stops).any(axis=1)  # a few stop ids: cheaper than isin
        self.handle[req[ended]] = NO_GRAMMAR
        return Accepts(fills.handles[live], toks, rows, rows[ended])

    def _pass_gates(self, fills: StepFills, requests: Sequence[Request], tokens: np.ndarray
                    ) -> None:
        """Gated rows' tokens at commit: counted as passed, and a gate token opens the gate (the
        grammar fills the row's next mask)."""
        live = _live(fills.gated, requests)
        rows, req = fills.gated[live], fills.gated_req[live]
        self.sent[req] += 1
        opened = tokens[rows] == self.gate[req]
        self.gate[req[opened]] = NO_GRAMMAR


def _live(rows: np.ndarray, requests: Sequence[Request]) -> np.ndarray:
    """Which of the sampling `rows` belong to requests not finished (zombies are skipped)."""
    return np.fromiter((not requests[j].finished for j in rows.tolist()), dtype=bool,
                       count=rows.size)
