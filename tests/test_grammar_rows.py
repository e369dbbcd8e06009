"""GrammarRows: which sampling rows a step's grammar job fills and which matchers accept its
tokens, from per-pool-row columns (no per-row Python in the engine's grammar step)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from photon.structured.bitmask import mask_numel, mask_views
from photon.structured.rows import GrammarRows

STOP = 2
WORDS = 3


def _request(handle: int | None, outputs: int = 0, gate: int | None = None) -> SimpleNamespace:
    grammar = None if handle is None else SimpleNamespace(handle=handle, terminated=False,
                                                          start_after=gate)
    return SimpleNamespace(grammar=grammar, finalized=False, output_token_ids=[7] * outputs)


def _step(table: GrammarRows, requests: list, pool_rows: list[int]) -> tuple:
    """A step whose sampling row j is requests[j] on pool row pool_rows[j]; its masks."""
    rows = [SimpleNamespace(request=r, out_index=len(r.output_token_ids)) for r in requests]
    counters = np.array([r.out_index for r in rows], dtype=np.int64)
    flat = torch.full((mask_numel(len(rows), WORDS),), 0x5A5A5A5A, dtype=torch.int32)
    mask = mask_views(flat, len(rows), WORDS)
    return rows, counters, mask


def test_fill_marks_only_live_grammar_rows() -> None:
    """Rows without a grammar and zombie rows get all bits and the tail set; live grammar rows
    are left to the job (tail 0); fills name the sampling row, handle and pool row."""
    table = GrammarRows(8, frozenset({STOP}), WORDS)
    reqs = [_request(None), _request(5), _request(3), _request(9)]
    pool = [6, 1, 4, 0]
    for r, p in zip(reqs, pool):
        table.assign(p, r)
    reqs[2].finalized = True  # a zombie: finalized while the step was in flight
    rows, counters, mask = _step(table, reqs, pool)
    fills = table.fill(rows, np.array(pool), counters, mask)
    assert fills.rows.tolist() == [1, 3]
    assert fills.handles.tolist() == [5, 9] and fills.pool_rows.tolist() == [1, 0]
    assert mask.tail.tolist() == [-1, 0, -1, 0]
    assert (mask.bits[0] == -1).all() and (mask.bits[2] == -1).all()
    assert (mask.bits[1] == 0x5A5A5A5A).all() and (mask.bits[3] == 0x5A5A5A5A).all()


def test_accept_skips_zombies_and_ends_grammars_on_stop_tokens() -> None:
    """The filled rows accept their tokens at commit, less those finalized meanwhile; a stop
    token terminates its grammar, whose row fills nothing after; sent counts what was handed on."""
    table = GrammarRows(4, frozenset({STOP, 99}), WORDS)
    reqs = [_request(10), _request(11), _request(12)]
    for p, r in enumerate(reqs):
        table.assign(p, r)
    rows, counters, mask = _step(table, reqs, [0, 1, 2])
    fills = table.fill(rows, np.arange(3), counters, mask)
    reqs[1].finalized = True  # e.g. its max_tokens was reached at the previous commit
    handles, tokens = table.accept(fills, rows, np.array([5, 6, STOP], dtype=np.int64))
    assert handles.tolist() == [10, 12] and tokens.tolist() == [5, STOP]
    assert tokens.dtype == np.int64
    assert [r.grammar.terminated for r in reqs] == [False, False, True]
    assert table.sent.tolist() == [1, 0, 1, 0]
    for r in (reqs[0], reqs[2]):
        r.output_token_ids.append(0)
    reqs[1].finalized = False  # not realistic, but shows only the stop token ends row 2
    rows, _, mask = _step(table, reqs, [0, 1, 2])
    fills = table.fill(rows, np.arange(3), np.array([1, 0, 1]), mask)
    assert fills.rows.tolist() == [0, 1]


def test_gated_rows_allow_all_until_their_gate_token_is_committed() -> None:
    """A row whose grammar starts after a token (the end of its reasoning) is not filled and
    accepts nothing; its tokens count as passed; the gate token opens it (also on the request,
    so a preempted request comes back ungated); the next fill is the grammar's."""
    gate = 77
    table = GrammarRows(4, frozenset({STOP}), WORDS)
    reqs = [_request(10, gate=gate), _request(11), _request(12, gate=gate)]
    for p, r in enumerate(reqs):
        table.assign(p, r)
    rows, counters, mask = _step(table, reqs, [0, 1, 2])
    fills = table.fill(rows, np.arange(3), counters, mask)
    assert fills.rows.tolist() == [1] and fills.gated.tolist() == [0, 2]
    assert mask.tail.tolist() == [-1, 0, -1] and (mask.bits[0] == -1).all()
    handles, tokens = table.accept(fills, rows, np.array([gate, 6, STOP], dtype=np.int64))
    assert handles.tolist() == [11] and tokens.tolist() == [6]  # gated rows reach no matcher
    assert table.sent.tolist() == [1, 1, 1, 0]
    assert [r.grammar.start_after for r in reqs] == [None, None, gate]
    assert not reqs[2].grammar.terminated  # a stop id under the gate does not end the grammar
    for r in reqs:
        r.output_token_ids.append(0)
    rows, counters, mask = _step(table, reqs, [0, 1, 2])
    fills = table.fill(rows, np.arange(3), counters, mask)
    assert fills.rows.tolist() == [0, 1] and fills.gated.tolist() == [2]
    assert fills.handles.tolist() == [10, 11]


def test_fill_before_the_last_token_was_handed_on_is_an_error() -> None:
    table = GrammarRows(2, frozenset({STOP}), WORDS)
    req = _request(4)
    table.assign(0, req)
    rows, _, mask = _step(table, [req], [0])
    with pytest.raises(AssertionError, match="before the previous token was committed"):
        table.fill(rows, np.array([0]), np.array([1]), mask)  # out_index 1, nothing handed on


def test_a_reused_pool_row_starts_from_its_new_request() -> None:
    """A pool row taken by another request (or by a preempted one coming back with outputs)
    holds that request's handle and output count."""
    table = GrammarRows(2, frozenset({STOP}), WORDS)
    table.assign(1, _request(3))
    table.assign(1, _request(None))
    assert table.handle[1] == -1
    table.assign(1, _request(8, outputs=5))
    assert table.handle[1] == 8 and table.sent[1] == 5
