"""Draft-model proposer: a small model sharing the target's tokenizer proposes K tokens greedily.

The proposer owns the loop, not the model: the runner that holds the draft model's weights and
its paged KV cache (the target's block tables and allocation lifetime) binds a `DraftStep`, one
decode step of the draft model for every row. Greedy drafting (the draft's argmax, as vLLM's
draft-model and EAGLE proposers do) makes the proposals deterministic given the history, so
`draft_probs` is None and verification accepts x_j with probability p_j(x_j): lossless.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from photon.spec.config import SpeculativeConfig
from photon.spec.proposer import PROPOSERS, Proposal, ProposeContext


class DraftStep(Protocol):
    def greedy(self, input_ids: Tensor, positions: Tensor, k: int) -> Tensor:
        """[B, k] int64: k draft-model decode steps for every row, the first from input_ids [B]
        at positions [B] (its KV written there), each next one from the previous argmax one
        position later. The draft's KV must hold every known token of each row but the last
        (positions < S-1). The runner's implementation may run the k steps as one graph."""
        ...


def greedy_steps(step: Callable[[Tensor, Tensor, int], Tensor], input_ids: Tensor,
                 positions: Tensor, k: int) -> Tensor:
    """`DraftStep.greedy` by k calls of a one-step function (ids, positions, j) -> logits."""
    drafts = []
    for j in range(k):
        input_ids = step(input_ids, positions, j).argmax(dim=-1)
        drafts.append(input_ids)
        positions = positions + 1
    return torch.stack(drafts, dim=1)


@PROPOSERS.register("draft_model")
class DraftModelProposer:
    """`SpeculativeConfig(method="draft_model", model=DIR, ...)`; `bind` the draft's step before
    the first `propose`."""

    name: str
    # Not on its own: its K steps need the runner's draft model, which the runner's sampling
    # graphs bind (photon.worker.spec_sample_graphs); eager sampling binds the draft graphs'.
    capturable = False

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.model = config.model
        self.max_model_len = max_model_len
        self._step: DraftStep | None = None

    def bind(self, step: DraftStep) -> None:
        self._step = step

    def propose(self, ctx: ProposeContext) -> Proposal:
        if self._step is None:
            raise RuntimeError("DraftModelProposer.propose before bind(): no draft model step")
        last = (ctx.seq_lens - 1).clamp(min=0)
        ids = ctx.token_pool[ctx.pool_rows, last].long()
        draft = self._step.greedy(ids, last, ctx.k)
        # A row may not propose past max_model_len (nor anything before its first token).
        room = (self.max_model_len - ctx.seq_lens).clamp(min=0, max=ctx.k)
        num = torch.where(ctx.seq_lens > 0, room, torch.zeros_like(room))
        j = torch.arange(ctx.k, device=draft.device)[None, :]
        draft = torch.where(j < num[:, None], draft, torch.zeros_like(draft))
        return Proposal(draft, num.to(torch.int32), None)
