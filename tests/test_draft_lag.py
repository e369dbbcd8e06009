"""The draft model's catch-up skipped while speculation is off (photon.worker.draft_lag): the
host bookkeeping, the fill chunks, and engines whose draft equals the target (every draft is
accepted exactly when the draft's KV cache holds every position), eager and with graphs."""

from __future__ import annotations

import numpy as np
import pytest

from photon.core.step import ScheduledRow
from photon.worker.draft_lag import DraftLag
from photon.worker.request_table import RequestTable
from tests.test_pipeline import run
from tests.test_spec_adaptive import _specs
from tests.test_spec_plain_rows import (
    _assert_every_kind,
    _draft_llm,
    _flapping,
    _kinds,
    _spec_rows,
    target,  # noqa: F401 - the module-scoped model fixture
)

BS = 4


def _row(req: int, start: int, n: int = 1, blocks: int = 8, speculative: bool = False
         ) -> ScheduledRow:
    return ScheduledRow(req, start, n, True, 0, [100 * req + b for b in range(blocks)],
                        speculative=speculative)


def _lag(num_rows: int, max_tokens: int = 32) -> DraftLag:
    """Request r holds blocks 100 r + b (as `_row` lists them; the table the runner syncs) and
    its first 64 tokens are in the pool."""
    table = RequestTable(num_rows, 8)
    table.block_tables[:] = [[100 * r + b for b in range(8)] for r in range(num_rows)]
    table.pool_valid[:] = 64
    return DraftLag(num_rows, 100 * num_rows, BS, 64, max_tokens, table)


def test_a_skipped_step_marks_where_each_request_starts_lagging() -> None:
    lag = _lag(4)
    assert lag.step([_row(1, 5), _row(2, 9)], False, True) == (True, [])
    assert lag.step([_row(1, 6), _row(2, 10), _row(3, 3)], False, True) == (True, [])
    assert lag.since.tolist() == [-1, 5, 9, 3]  # the first skipped position, not the last
    lag.reset(3)  # the index left the table
    skip, chunks = lag.step([_row(1, 7), _row(2, 11)], True, True)
    assert not skip and len(chunks) == 1 and lag.since.tolist() == [-1] * 4
    c = chunks[0]
    assert c.positions.tolist() == [5, 6, 9, 10]
    assert c.pool_idx.tolist() == [64 + 5, 64 + 6, 128 + 9, 128 + 10]
    assert c.seq_lens.tolist() == [7, 11] and c.query_lens.tolist() == [2, 2]
    # slots from the rows' own blocks: position p of request r is block 100 r + p // 4
    assert c.slot_mapping.tolist() == [101 * BS + 1, 101 * BS + 2, 202 * BS + 1, 202 * BS + 2]
    assert c.block_tables[1, :3].tolist() == [200, 201, 202]
    # in step again: nothing to fill
    assert lag.step([_row(1, 8), _row(2, 12)], True, True) == (False, [])


def test_only_plain_decode_steps_without_proposals_skip_the_draft() -> None:
    """A step that proposes, or that is no plain decode step (a prompt chunk: its blocks may be
    a later request's cached prefix; a speculative row), runs the draft, filling first."""
    lag = _lag(2)
    assert lag.step([_row(0, 3)], False, True) == (True, [])
    skip, chunks = lag.step([_row(0, 4), _row(1, 0, n=6)], False, False)  # a prompt chunk
    assert not skip and chunks[0].positions.tolist() == [3]
    assert lag.step([_row(0, 5)], True, True) == (False, [])
    assert lag.since.tolist() == [-1, -1]


def test_long_gaps_are_cut_into_chunks_a_request_at_most_once_per_chunk() -> None:
    lag = _lag(3, max_tokens=8)
    lag.step([_row(0, 2), _row(1, 10), _row(2, 0)], False, True)
    _, chunks = lag.step([_row(0, 22), _row(1, 13), _row(2, 3)], True, True)
    pieces = [list(zip((c.pool_idx // 64).tolist(), c.positions.tolist())) for c in chunks]
    assert all(len(c.positions) <= 8 for c in chunks)
    got = sorted(p for chunk in pieces for p in chunk)
    want = sorted([(0, p) for p in range(2, 22)] + [(1, p) for p in range(10, 13)]
                  + [(2, p) for p in range(0, 3)])
    assert got == want  # every skipped position exactly once
    for c in chunks:  # each segment attends to its own end, one segment per request
        reqs = (c.pool_idx // 64)[np.cumsum(c.query_lens) - 1]
        assert len(set(reqs.tolist())) == len(reqs)
        ends = c.positions[np.cumsum(c.query_lens) - 1] + 1
        assert ends.tolist() == c.seq_lens.tolist()
    # request 0's pieces run in order: 2-9, 10-17, 18-21
    firsts = [c.positions[0] for c in chunks if c.pool_idx[0] // 64 == 0]
    assert firsts == sorted(firsts)


def test_a_cached_prefix_with_skipped_positions_is_filled_for_the_next_request() -> None:
    """Request 1 decodes positions 5 and 6 (block 101) with the draft skipped and leaves
    unfilled; request 2's cached prefix holds that block (shared blocks 100, 101, 102 of 1):
    its first row lags from the block's first position, the fill covers it, and the block is no
    longer marked."""
    lag = _lag(4)
    lag.step([_row(1, 5), _row(0, 9)], False, True)
    lag.step([_row(1, 6), _row(0, 10)], False, True)
    assert lag.missing[[101, 2]].all() and lag.missing.sum() == 2
    lag.reset(1)  # request 1 finished lagging
    shared = ScheduledRow(2, 12, 1, True, 0, [100, 101, 102, 200])  # a 12-token cached prefix
    skip, chunks = lag.step([shared], True, True)
    assert not skip and chunks[0].positions.tolist() == list(range(4, 12))
    assert chunks[0].slot_mapping.tolist()[:4] == [101 * BS + i for i in range(4)]
    assert not lag.missing[101] and lag.missing[2]
    # a fresh request whose prefix has no marked block lags from nowhere
    assert lag.step([ScheduledRow(3, 4, 1, True, 0, [100, 300])], True, True) == (False, [])


def _count_draft_work(llm: object) -> dict[str, int]:
    draft = llm.engine.runner.draft
    counts = {"catch_up": 0, "fill": 0}
    catch_up, fill = draft.catch_up, draft.fill

    def counted_catch_up(*a, **k):  # noqa: ANN002, ANN003, ANN202
        counts["catch_up"] += 1
        return catch_up(*a, **k)

    def counted_fill(chunks, pool):  # noqa: ANN001, ANN202
        counts["fill"] += len(chunks)
        return fill(chunks, pool)

    draft.catch_up, draft.fill = counted_catch_up, counted_fill
    return counts


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_flapping_switch_skips_the_draft_and_fills_it_back(target: str,  # noqa: F811
                                                             pipelined: bool) -> None:
    """A draft equal to the target accepts every draft only if its KV cache holds every
    position when it proposes: the positions of the steps it skipped included."""
    specs = _specs()
    base, _ = run(_draft_llm(target, None, True), specs)
    llm = _draft_llm(target, target, pipelined, block_size=4, max_num_batched_tokens=16)
    policy = _flapping(llm)
    counts = _count_draft_work(llm)
    out, audit = run(llm, specs)
    assert out == base
    _assert_every_kind(_kinds(audit, policy.choices))
    steps = sum(bool(rows) for rows in audit.schedule)
    assert 0 < counts["catch_up"] < steps and counts["fill"] > 0
    drafts = _spec_rows(audit)
    counters = llm.engine.runner.spec.counters
    assert counters.num_drafts == len(drafts) > 0
    assert counters.num_accepted_tokens == sum(drafts)


def test_skipped_steps_replay_the_lean_decode_graphs(target: str,  # noqa: F811
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_spec_graphs import _install_graphs

    specs = _specs()
    base, _ = run(_draft_llm(target, None, True), specs)
    llm = _draft_llm(target, target, True, block_size=4, max_num_seqs=4)
    policy = _flapping(llm)
    graphs = _install_graphs(llm, monkeypatch)
    out, audit = run(llm, specs)
    assert out == base
    _assert_every_kind(_kinds(audit, policy.choices))
    assert graphs.lean_replays > 0 and graphs.decode.replays > 0 and graphs.spec_replays > 0
    drafts = _spec_rows(audit)
    counters = llm.engine.runner.spec.counters
    assert counters.num_accepted_tokens == sum(drafts) > 0


class _Switch:
    """A policy the test turns on and off."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, batch_size: int) -> int:
        return self.k

    def committed(self, step: int, batch_size: int, k: int, decode_only: bool,
                  tokens: int) -> None:
        pass


def test_a_next_turn_hits_an_answer_decoded_with_the_draft_skipped(target: str) -> None:  # noqa: F811
    """Turn 1 decodes with speculation off (the draft skipped); turn 2's prompt is turn 1's prompt
    and answer, served from the prefix cache, and speculates: the draft, equal to the target,
    has every draft accepted only if the cached answer's positions were filled first."""
    from photon import SamplingParams
    from tests.test_spec_adaptive import K

    llm = _draft_llm(target, target, True, block_size=4)
    switch = _Switch(0)
    llm.engine.scheduler.spec_policy = switch
    prompt = list(range(3, 23))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    answer = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    switch.k = K
    second = llm.generate([prompt + answer + [7, 8]], greedy, use_tqdm=False)[0]
    llm.engine.assert_drained()
    assert second.num_cached_tokens >= len(prompt) + len(answer) - 4  # the answer's blocks
    counters = llm.engine.runner.spec.counters
    assert counters.num_drafts > 0
    assert counters.num_accepted_tokens == counters.num_draft_tokens


def _staged_blocks(llm: object) -> list[tuple[tuple[int, ...], list[int]]]:
    """Record, for every step the runner prepares, the staged block table's shape and the
    blocks each row's request holds (what the scheduler reserved)."""
    runner = llm.engine.runner  # type: ignore[attr-defined]
    prepare = runner.prepare
    seen: list[tuple[tuple[int, ...], list[int]]] = []

    def recorded(plan):  # noqa: ANN001, ANN202
        prep = prepare(plan)
        if prep is not None:
            seen.append((tuple(prep.host.inputs.block_tables.shape),
                         [len(r.block_ids) for r in plan.rows]))
        return prep

    runner.prepare = recorded
    return seen


def test_steps_that_propose_nothing_reserve_no_draft_lookahead(target: str) -> None:  # noqa: F811
    """With the switch off, a draft engine's rows hold the blocks and stage the block tables a
    plain engine's do: the K positions past a sampling row are for the draft's steps after
    sampling, which run only in a step that proposes."""
    specs = _specs()
    plain = _draft_llm(target, None, True, block_size=4)
    off = _draft_llm(target, target, True, block_size=4)
    off.engine.scheduler.spec_policy = _Switch(0)
    seen_plain, seen_off = _staged_blocks(plain), _staged_blocks(off)
    out, _ = run(plain, specs)
    assert run(off, specs)[0] == out
    assert seen_off == seen_plain and len(seen_plain) > 10


def test_the_rows_arrays_of_a_decode_step_stand_for_the_rows() -> None:
    """The runner passes a decode step's pool rows and positions (one per row) instead of the
    rows' own fields: the same marks and fills."""
    by_rows, by_arrays = _lag(4), _lag(4)
    for rows, propose in (([_row(1, 5), _row(2, 9)], False), ([_row(1, 6), _row(2, 10)], False),
                          ([_row(1, 7), _row(2, 11)], True)):
        arrays = (np.array([r.req_index for r in rows]), np.array([r.start for r in rows]))
        a, b = by_rows.step(rows, propose, True), by_arrays.step(rows, propose, True, arrays)
        assert a[0] == b[0] and [c.positions.tolist() for c in a[1]] == \
            [c.positions.tolist() for c in b[1]]
        assert by_rows.since.tolist() == by_arrays.since.tolist()
        assert (by_rows.missing == by_arrays.missing).all()
