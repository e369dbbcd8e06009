"""The device n-gram proposer against a plain-Python reference."""

from __future__ import annotations

import random

import pytest
import torch

from photon.spec.config import SpeculativeConfig
from photon.spec.ngram import NgramProposer, propose_ngram
from photon.spec.proposer import PROPOSERS, ProposeContext, build_proposer


def reference(tokens: list[int], k: int, min_n: int, max_n: int, max_model_len: int,
              window: int | None = None) -> list[int]:
    """Longest n in [min_n, max_n] whose suffix occurs ending before the last token (inside the
    last `window` tokens), its latest occurrence, the <= k known tokens after it."""
    s = len(tokens)
    first = 0 if window is None else max(0, s - window)
    room = max(0, min(k, max_model_len - s))
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[s - n:] if n <= s else None
        for end in range(s - 2, first + n - 2, -1):
            if suffix is not None and tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + room]
    return []


def run(rows: list[list[int]], k: int, min_n: int, max_n: int, max_model_len: int = 10**6,
        window: int | None = None, pool_len: int = 64) -> list[list[int]]:
    """The device proposer on `rows` placed in shuffled pool rows with garbage past seq_len."""
    gen = random.Random(len(rows) * 7 + k)
    order = list(range(len(rows) + 2))
    gen.shuffle(order)
    pool = torch.randint(0, 99, (len(rows) + 2, pool_len), dtype=torch.int32)
    for b, toks in enumerate(rows):
        pool[order[b], :len(toks)] = torch.tensor(toks, dtype=torch.int32)
    ctx = ProposeContext(pool, torch.tensor(order[:len(rows)]),
                         torch.tensor([len(t) for t in rows]), k)
    out = propose_ngram(ctx, min_n, max_n, max_model_len, window)
    assert out.draft_ids.shape == (len(rows), k) and out.draft_ids.dtype == torch.int64
    assert out.num_draft.dtype == torch.int32 and out.draft_probs is None
    got = []
    for b in range(len(rows)):
        n = int(out.num_draft[b])
        assert out.draft_ids[b, n:].eq(0).all()  # padding is token 0
        got.append(out.draft_ids[b, :n].tolist())
    return got


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 3), (2, 6)])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_random_rows_match_the_reference(min_n: int, max_n: int, k: int) -> None:
    gen = random.Random(min_n * 100 + max_n * 10 + k)
    rows = [[gen.randrange(3) for _ in range(gen.randrange(0, 40))] for _ in range(40)]
    assert run(rows, k, min_n, max_n) == [reference(r, k, min_n, max_n, 10**6) for r in rows]


def test_crafted_rows() -> None:
    rows = [
        [1, 2, 3, 9, 9, 1, 2, 3],  # 3-gram match: proposes what followed it
        [1, 2, 3, 4, 5, 1, 2, 3, 7, 1, 2, 3],  # the most recent occurrence wins (7, not 4)
        [5, 6, 7, 8, 1, 2, 7, 8],  # the 2-gram "7 8" only; the longer 3-gram is absent
        [4, 5, 6, 7],  # no match
        [3, 3, 3, 3],  # overlapping occurrence just before the end: a partial proposal
        [7, 8, 9, 7, 8],  # the match ends right before the suffix: 1 token known after it
        [2],  # one token: nothing earlier to match
        [],  # an empty row
    ]
    assert run(rows, 3, 2, 3) == [[9, 9, 1], [7, 1, 2], [1, 2, 7], [], [3], [9, 7, 8], [], []]
    assert run(rows, 3, 2, 3) == [reference(r, 3, 2, 3, 10**6) for r in rows]


def test_longest_match_beats_a_more_recent_shorter_one() -> None:
    row = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]  # "2 3" recurs later (-> 5), "1 2 3" earlier (-> 4)
    assert run([row], 2, 1, 3) == [[4, 9]]
    assert run([row], 2, 1, 2) == [[5, 1]]  # capped at 2-grams: the latest "2 3" wins


def test_max_model_len_and_window_cut_proposals() -> None:
    row = [1, 2, 3, 4, 5, 6, 1, 2]
    assert run([row], 4, 2, 2) == [[3, 4, 5, 6]]
    assert run([row], 4, 2, 2, max_model_len=10) == [[3, 4]]
    assert run([row], 4, 2, 2, max_model_len=8) == [[]]
    assert run([row], 4, 2, 2, window=7) == [[]]  # the earlier "1 2" starts outside the window
    gen = random.Random(5)
    rows = [[gen.randrange(3) for _ in range(gen.randrange(0, 60))] for _ in range(30)]
    assert run(rows, 4, 1, 4, window=12) == [reference(r, 4, 1, 4, 10**6, 12) for r in rows]
    assert run(rows, 4, 1, 4, max_model_len=40) == [reference(r, 4, 1, 4, 40) for r in rows]


def test_a_full_pool_row_is_searched_to_its_end() -> None:
    row = [0, 1, 2, 3] * 4
    assert run([row], 3, 1, 4, pool_len=16) == [[0, 1, 2]]


def test_registry_builds_the_ngram_proposer() -> None:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1,
                               prompt_lookup_max=2)
    proposer = build_proposer(config, max_model_len=100)
    assert isinstance(proposer, NgramProposer) and proposer.name == "ngram"
    assert PROPOSERS.names() == ["draft_model", "ngram"]
    pool = torch.tensor([[5, 6, 7, 5, 6]], dtype=torch.int32)
    out = proposer.propose(ProposeContext(pool, torch.tensor([0]), torch.tensor([5]), 2))
    assert out.draft_ids.tolist() == [[7, 5]] and out.num_draft.tolist() == [2]


def test_meta_device_runs_without_reading_values() -> None:
    """Shapes alone decide the work: on the meta device (no data) any host sync would raise."""
    ctx = ProposeContext(torch.empty(6, 32, dtype=torch.int32, device="meta"),
                         torch.empty(4, dtype=torch.int64, device="meta"),
                         torch.empty(4, dtype=torch.int64, device="meta"), 3)
    out = propose_ngram(ctx, 2, 4, 100)
    assert out.draft_ids.shape == (4, 3) and out.num_draft.shape == (4,)
