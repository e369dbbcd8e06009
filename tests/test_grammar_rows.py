"""GrammarRows: which sampling rows a step's grammar job fills and which matchers accept its
tokens, from per-request-index columns (no per-row Python in the engine's grammar step)."""

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
    grammar = None if handle is None else SimpleNamespace(handle=handle, start_after=gate)
    return SimpleNamespace(grammar=grammar, finished=False, output_token_ids=[7] * outputs)


def _step(requests: list) -> tuple:
    """A step whose sampling row j is requests[j]: its counters and masks."""
    counters = np.array([len(r.output_token_ids) for r in requests], dtype=np.int64)
    flat = torch.full((mask_numel(len(requests), WORDS),), 0x5A5A5A5A, dtype=torch.int32)
    return counters, mask_views(flat, len(requests), WORDS)


def test_fill_marks_only_live_grammar_rows() -> None:
    """Rows without a grammar and zombie rows get all bits and the tail set; live grammar rows
    are left to the job (tail 0); fills name the sampling row, handle and request index."""
    table = GrammarRows(8, frozenset({STOP}), WORDS)
    reqs = [_request(None), _request(5), _request(3), _request(9)]
    index = np.array([6, 1, 4, 0])
    for r, i in zip(reqs, index):
        table.assign(int(i), r)
    reqs[2].finished = True  # a zombie: finished while the step was in flight
    counters, mask = _step(reqs)
    fills = table.fill(reqs, index, counters, mask)
    assert fills.rows.tolist() == [1, 3]
    assert fills.handles.tolist() == [5, 9] and fills.req.tolist() == [1, 0]
    assert mask.tail.tolist() == [-1, 0, -1, 0]
    assert (mask.bits[0] == -1).all() and (mask.bits[2] == -1).all()
    assert (mask.bits[1] == 0x5A5A5A5A).all() and (mask.bits[3] == 0x5A5A5A5A).all()


def test_accept_skips_zombies_and_returns_the_grammars_a_stop_token_ends() -> None:
    """The filled rows accept their tokens at commit, less those finished meanwhile; a stop
    token ends its grammar (returned, for the scheduler), whose row fills nothing after; sent
    counts what was handed on."""
    table = GrammarRows(4, frozenset({STOP, 99}), WORDS)
    reqs = [_request(10), _request(11), _request(12)]
    for i, r in enumerate(reqs):
        table.assign(i, r)
    counters, mask = _step(reqs)
    fills = table.fill(reqs, np.arange(3), counters, mask)
    reqs[1].finished = True  # e.g. its max_tokens was reached at the previous commit
    accepts = table.accept(fills, reqs, np.array([5, 6, STOP], dtype=np.int64))
    assert accepts.handles.tolist() == [10, 12] and accepts.tokens.tolist() == [5, STOP]
    assert accepts.tokens.dtype == np.int64
    assert accepts.rows.tolist() == [0, 2] and accepts.ended.tolist() == [2]
    assert table.sent.tolist() == [1, 0, 1, 0]
    for r in (reqs[0], reqs[2]):
        r.output_token_ids.append(0)
    reqs[1].finished = False  # not realistic, but shows only the stop token ends row 2
    _, mask = _step(reqs)
    fills = table.fill(reqs, np.arange(3), np.array([1, 0, 1]), mask)
    assert fills.rows.tolist() == [0, 1]


def test_gated_rows_allow_all_until_their_gate_token_is_committed() -> None:
    """A row whose grammar starts after a token (the end of its reasoning) is not filled and
    accepts nothing; its tokens count as passed; the gate token opens it; the next fill is the
    grammar's."""
    gate = 77
    table = GrammarRows(4, frozenset({STOP}), WORDS)
    reqs = [_request(10, gate=gate), _request(11), _request(12, gate=gate)]
    for i, r in enumerate(reqs):
        table.assign(i, r)
    counters, mask = _step(reqs)
    fills = table.fill(reqs, np.arange(3), counters, mask)
    assert fills.rows.tolist() == [1] and fills.gated.tolist() == [0, 2]
    assert mask.tail.tolist() == [-1, 0, -1] and (mask.bits[0] == -1).all()
    accepts = table.accept(fills, reqs, np.array([gate, 6, STOP], dtype=np.int64))
    assert accepts.handles.tolist() == [11] and accepts.tokens.tolist() == [6]  # gated: no matcher
    assert accepts.ended.size == 0  # a stop id under the gate does not end the grammar
    assert table.sent.tolist() == [1, 1, 1, 0]
    assert table.gate.tolist()[:3] == [-1, -1, gate]
    reqs[0].output_token_ids.append(gate)
    for r in reqs[1:]:
        r.output_token_ids.append(0)
    counters, mask = _step(reqs)
    fills = table.fill(reqs, np.arange(3), counters, mask)
    assert fills.rows.tolist() == [0, 1] and fills.gated.tolist() == [2]
    assert fills.handles.tolist() == [10, 11]


def test_a_readmitted_request_is_ungated_once_its_outputs_hold_the_gate_token() -> None:
    """A preempted request comes back at a new index: its gate is open if the gate token is
    among its committed outputs, closed otherwise (nothing is written back into the request)."""
    gate = 77
    table = GrammarRows(4, frozenset({STOP}), WORDS)
    passed, waiting = _request(10, gate=gate), _request(11, gate=gate)
    passed.output_token_ids += [gate, 5]
    table.assign(0, passed)
    table.assign(1, waiting)
    assert table.gate.tolist()[:2] == [-1, gate]
    assert table.sent.tolist()[:2] == [2, 0]
    assert passed.grammar.start_after == gate  # the request's spec is left as it was


def test_fill_before_the_last_token_was_handed_on_is_an_error() -> None:
    table = GrammarRows(2, frozenset({STOP}), WORDS)
    req = _request(4)
    table.assign(0, req)
    _, mask = _step([req])
    with pytest.raises(AssertionError, match="before the previous token was committed"):
        table.fill([req], np.array([0]), np.array([1]), mask)  # out_index 1, nothing handed on


def test_a_reused_index_starts_from_its_new_request() -> None:
    """An index taken by another request (or by a preempted one coming back with outputs)
    holds that request's handle and output count."""
    table = GrammarRows(2, frozenset({STOP}), WORDS)
    table.assign(1, _request(3))
    table.assign(1, _request(None))
    assert table.handle[1] == -1
    table.assign(1, _request(8, outputs=5))
    assert table.handle[1] == 8 and table.sent[1] == 5
