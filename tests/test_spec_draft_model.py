"""The draft-model proposer's loop, with a stand-in draft step (the runner binds the real one)."""

from __future__ import annotations

import pytest
import torch

from photon.spec.config import SpeculativeConfig
from photon.spec.draft_model import DraftModelProposer, greedy_steps
from photon.spec.proposer import ProposeContext, build_proposer

V = 11


class CountingStep:
    """A 'model' whose next token is (token + position) % V; records what it was fed."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int], int]] = []

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step: int) -> torch.Tensor:
        self.calls.append((input_ids.tolist(), positions.tolist(), step))
        return torch.nn.functional.one_hot((input_ids + positions) % V, V).float()

    def greedy(self, input_ids: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
        return greedy_steps(self, input_ids, positions, k)


def proposer(k: int, max_model_len: int = 100) -> tuple[DraftModelProposer, CountingStep]:
    config = SpeculativeConfig("draft_model", k, model="/models/draft")
    built = build_proposer(config, max_model_len)
    assert isinstance(built, DraftModelProposer) and built.model == "/models/draft"
    step = CountingStep()
    built.bind(step)
    return built, step


def test_greedy_drafts_from_the_last_known_token() -> None:
    prop, step = proposer(3, max_model_len=12)
    pool = torch.full((3, 12), 9, dtype=torch.int32)
    pool[1, :4] = torch.tensor([1, 2, 3, 4])
    pool[2, :2] = torch.tensor([5, 6])
    ctx = ProposeContext(pool, torch.tensor([1, 2, 0]), torch.tensor([4, 2, 10]), 3)
    out = prop.propose(ctx)
    # Row 0: token 4 at position 3 -> 7 at 4 -> (7 + 4) % 11 = 0 at 5 -> 5.
    assert step.calls[0] == ([4, 6, 9], [3, 1, 9], 0)
    assert out.draft_ids[:2].tolist() == [[7, 0, 5], [7, 9, 1]]
    # Row 2 has 10 of max_model_len=12 tokens: room for 2 drafts only.
    assert out.num_draft.tolist() == [3, 3, 2] and out.draft_ids[2].tolist() == [7, 6, 0]
    assert out.draft_probs is None


def test_propose_before_bind_is_an_error() -> None:
    config = SpeculativeConfig("draft_model", 2, model="/models/draft")
    with pytest.raises(RuntimeError, match="before bind"):
        DraftModelProposer(config, 10).propose(
            ProposeContext(torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0]),
                           torch.tensor([2]), 2))
