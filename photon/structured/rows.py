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

Speculative rows (n-gram speculation: photon.spec.ngram_host): a row verifying k drafts has k + 1
mask rows (`RowLayout`). The drafts are the device's n-gram proposal, which the host recomputes
from the request's known tokens (its prompt and the outputs handed on here), so mask j can be the
grammar's state after drafts 0..j-1: the job accepts the drafts one by one while it fills, then
rolls them back (photon.structured.executor.run_job). At commit the row's matcher accepts its 1
to k + 1 tokens, up to its grammar's stop token. Gated rows are never speculative (the scheduler
runs a gated grammar request's rows plain until its gate opened).

Invariant (checked at every fill): a grammar row's mask is built only once every output before
its `out_index` was handed to its matcher. (A speculative row's output index is resolved on the
device; its fill follows the accepts of every step before it, so its matcher holds them too.)
"""

from __future__ import annotations

from collections.abc import Callable
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
    # With a RowLayout (a step with speculative rows): the layout its masks and tokens follow,
    # each filled row's first mask row and its drafts.
    layout: RowLayout | None = None
    mask_rows: np.ndarray | None = None  # [F] the rows' first mask rows (None: `rows`)
    num_drafts: np.ndarray = field(default_factory=lambda: _EMPTY)  # [F], or empty: none
    draft_tokens: np.ndarray = field(default_factory=lambda: _EMPTY)  # concatenated


@dataclass(frozen=True)
class RowLayout:
    """A step's sampling rows on its mask rows (the sampler's rows, its tokens): sampling row j
    has width[j] of them from first[j]; a speculative row verifying k drafts has k + 1."""

    first: np.ndarray  # [S] int64
    width: np.ndarray  # [S] int64

    @classmethod
    def of(cls, widths: np.ndarray) -> RowLayout | None:
        """None when every width is 1 (mask rows are sampling rows)."""
        if not (widths > 1).any():
            return None
        return cls(np.cumsum(widths) - widths, widths)

    @property
    def total(self) -> int:
        return int(self.first[-1] + self.width[-1])


@dataclass(frozen=True)
class Accepts:
    """A commit's accepts: matcher handles[i] takes tokens[i], for sampling row rows[i] (a
    speculative row's tokens in order); the sampling rows `ended` took their grammar's stop token,
    as their committed token ended_at[i] (0 for plain rows)."""

    handles: np.ndarray
    tokens: np.ndarray
    rows: np.ndarray
    ended: np.ndarray
    ended_at: np.ndarray = field(default_factory=lambda: _EMPTY)


Drafter = Callable[[np.ndarray], np.ndarray]  # known tokens -> the device's n-gram drafts


class GrammarRows:
    def __init__(self, num_rows: int, stop_token_ids: frozenset[int], mask_words: int,
                 drafter: Drafter | None = None) -> None:
        self.handle = np.full(num_rows, NO_GRAMMAR, dtype=np.int64)
        self.sent = np.zeros(num_rows, dtype=np.int64)
        self.gate = np.full(num_rows, NO_GRAMMAR, dtype=np.int64)
        self.stops = np.array(sorted(stop_token_ids), dtype=np.int64)
        self._stop_set = frozenset(stop_token_ids)
        self.views = MaskViews(mask_words)  # a step's masks over the host and device buffers
        # With speculation: each grammar request's known tokens (prompt, then the outputs handed
        # on here), the n-gram proposal's input, by request index.
        self.drafter = drafter
        self.known: dict[int, list[int]] = {}

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
        if self.drafter is not None and grammar is not None:
            self.known[i] = [*req.prompt_token_ids, *req.output_token_ids]

    def release(self, i: int) -> None:
        """Index `i` left the runner's table."""
        self.handle[i] = NO_GRAMMAR
        self.known.pop(i, None)

    def fill(self, requests: Sequence[Request], req: np.ndarray, counters: np.ndarray,
             mask: TokenMask, layout: RowLayout | None = None) -> StepFills:
        """The rows of a step's `mask` (host; sampling row j is `requests[j]` at request index
        `req[j]`, on mask rows `layout`'s, or row j without one) its grammar job fills; every
        other row gets all bits and the tail set (no constraint), a filled row's tail is 0 (ids
        past the backend's words are not allowed). counters[j] < 0: a speculative row (its
        output index is the device's)."""
        handles = self.handle[req]
        cand = np.flatnonzero(handles >= 0)
        rows = cand[_live(cand, requests)]
        exact = counters[rows] >= 0
        assert np.array_equal(self.sent[req[rows]][exact], counters[rows][exact]), \
            "grammar mask built before the previous token was committed"
        gated = self.gate[req[rows]] >= 0
        if gated.any():
            rows, gated_rows = rows[~gated], rows[gated]
        else:
            gated_rows = _EMPTY
        fills = StepFills(rows, handles[rows], req[rows], gated_rows, req[gated_rows])
        bits, tail = mask.host_arrays()
        tail.fill(ALLOW_ALL)
        targets = rows if layout is None else self._draft(fills, layout)
        if targets.size < bits.shape[0]:
            free = np.ones(bits.shape[0], dtype=bool)
            free[targets] = False
            bits[free] = ALLOW_ALL
        tail[targets] = 0
        return fills

    def _draft(self, fills: StepFills, layout: RowLayout) -> np.ndarray:
        """The filled rows' mask rows and drafts (into `fills`) on a step with speculative rows;
        returns the mask rows the job writes: a row's first, and one more per draft."""
        fills.layout = layout
        fills.mask_rows = layout.first[fills.rows]
        counts, drafts, targets = [], [], []
        for j, i, first in zip(fills.rows.tolist(), fills.req.tolist(), fills.mask_rows.tolist()):
            k = int(layout.width[j]) - 1
            assert k == 0 or self.drafter is not None, "grammar rows speculate with ngram only"
            d = self.drafter(np.asarray(self.known[i], dtype=np.int64))[:k] if k else _EMPTY
            counts.append(d.size)
            drafts.append(d)
            targets.extend(range(first, first + 1 + d.size))
        fills.num_drafts = np.array(counts, dtype=np.int64)
        fills.draft_tokens = np.concatenate(drafts) if drafts else _EMPTY
        return np.array(targets, dtype=np.int64)

    def accept(self, fills: StepFills, requests: Sequence[Request], tokens: np.ndarray
               ) -> Accepts:
        """What the matchers accept at the step's commit (`tokens`: the step's sampled tokens on
        its mask rows, -1 or less past a speculative row's emitted ones). A matcher accepts a stop
        token only where its grammar may end, and is terminated exactly then, so the scheduler
        finishes the request in this commit without waiting for the accept."""
        if fills.gated.size:
            self._pass_gates(fills, requests, tokens)
        if not fills.rows.size:
            return Accepts(_EMPTY, _EMPTY, _EMPTY, _EMPTY)
        live = _live(fills.rows, requests)
        if fills.layout is not None:
            return self._accept_rows(fills, live, tokens)
        rows, req = fills.rows[live], fills.req[live]
        toks = tokens[rows]  # fancy indexing copies: the slot's buffer is reused at t+2
        self.sent[req] += 1
        ended = (toks[:, None] == self.stops).any(axis=1)  # a few stop ids: cheaper than isin
        self.handle[req[ended]] = NO_GRAMMAR
        if self.known:
            self._extend(req, toks)
        return Accepts(fills.handles[live], toks, rows, rows[ended], np.zeros_like(rows[ended]))

    def _accept_rows(self, fills: StepFills, live: np.ndarray, tokens: np.ndarray) -> Accepts:
        """`accept` on a step with speculative rows: each row's emitted tokens in order, up to
        its grammar's stop token (what follows it is never committed)."""
        handles, toks, rows, ended, ended_at = [], [], [], [], []
        first, width = fills.layout.first, fills.layout.width
        for j, i, h in zip(fills.rows[live].tolist(), fills.req[live].tolist(),
                           fills.handles[live].tolist()):
            row = tokens[first[j]:first[j] + width[j]]
            row = row[row >= 0].tolist()  # the emitted tokens are a prefix
            stop = next((n for n, t in enumerate(row) if t in self._stop_set), None)
            if stop is not None:
                row = row[:stop + 1]
                ended.append(j)
                ended_at.append(stop)
                self.handle[i] = NO_GRAMMAR
            self.sent[i] += len(row)
            if i in self.known:
                self.known[i].extend(row)
            handles += [h] * len(row)
            toks += row
            rows += [j] * len(row)
        return Accepts(*(np.array(a, dtype=np.int64) for a in (handles, toks, rows, ended,
                                                                ended_at)))

    def _extend(self, req: np.ndarray, toks: np.ndarray) -> None:
        for i, t in zip(req.tolist(), toks.tolist()):
            known = self.known.get(i)
            if known is not None:
                known.append(t)

    def _pass_gates(self, fills: StepFills, requests: Sequence[Request], tokens: np.ndarray
                    ) -> None:
        """Gated rows' tokens at commit: counted as passed, and a gate token opens the gate (the
        grammar fills the row's next mask). Gated rows are plain: one token each."""
        live = _live(fills.gated, requests)
        rows, req = fills.gated[live], fills.gated_req[live]
        toks = tokens[rows if fills.layout is None else fills.layout.first[rows]]
        self.sent[req] += 1
        opened = toks == self.gate[req]
        self.gate[req[opened]] = NO_GRAMMAR
        if self.known:
            self._extend(req, toks)


def _live(rows: np.ndarray, requests: Sequence[Request]) -> np.ndarray:
    """Which of the sampling `rows` belong to requests not finished (zombies are skipped)."""
    return np.fromiter((not requests[j].finished for j in rows.tolist()), dtype=bool,
                       count=rows.size)
