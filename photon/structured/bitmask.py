"""Next-token masks: filled on the host at finalize(t+1), applied on the device in the sampler.

Layout of one step's masks for R sampling rows, packed in one flat int32 buffer (one H2D copy):
  bits [R, W]  the backend's packing (xgrammar's): bit `v % 32` of word `v // 32` set = token v
               allowed, for the ids the backend covers, v < 32 * W (W = `mask_words`, the
               tokenizer's ids; it may be narrower than the model's padded vocabulary)
  tail [R]     whether ids v >= 32 * W are allowed: 0 under a grammar, -1 without one; it starts
               on a 16-byte boundary (Triton specializes kernels on pointer alignment, so an
               offset that moved with R would compile a second variant mid-run)
Rows without a grammar, zombie rows (finalized at commit(t)) and terminated grammars get all bits
and the tail set: no constraint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from photon.engine.scheduler import ScheduledRow

ALLOW_ALL = -1


@dataclass
class TokenMask:
    bits: torch.Tensor  # [R, W] int32
    tail: torch.Tensor  # [R] int32
    flat: torch.Tensor | None = None  # both, and the padding between them: one copy moves all

    @property
    def numel(self) -> int:
        return self.bits.numel() + self.tail.numel()


def _tail_offset(rows: int, words: int) -> int:
    return (rows * words + 3) // 4 * 4


def mask_numel(rows: int, words: int) -> int:
    return _tail_offset(rows, words) + rows


def mask_views(flat: torch.Tensor, rows: int, words: int) -> TokenMask:
    """The layout above over the head of a flat int32 buffer (host or device)."""
    bits = flat[:rows * words].view(rows, words)
    tail = _tail_offset(rows, words)
    return TokenMask(bits, flat[tail:tail + rows], flat[:tail + rows])


def grammar_rows(rows: list[ScheduledRow], mask: TokenMask) -> list[tuple[int, Any]]:
    """Row j of `mask` (host tensors) is for the j-th sampling row. Rows without a live grammar
    (none, zombie, terminated or rejected) get all bits and the tail set; returns (j, grammar) for
    the rows left to the grammar executor (their tail is 0). Every output before a grammar row's
    `out_index` must have been handed to its matcher."""
    todo: list[tuple[int, Any]] = []
    for j, row in enumerate(rows):
        req = row.request
        grammar = req.grammar
        if grammar is None or req.finalized or grammar.terminated or grammar.rejected:
            continue
        assert grammar.num_sent == row.out_index, \
            "grammar mask built before the previous token was committed"
        todo.append((j, grammar))
    bits, tail = mask.bits.numpy(), mask.tail.numpy()
    grammar_js = [j for j, _ in todo]
    tail.fill(ALLOW_ALL)
    if len(todo) < len(rows):
        free = np.ones(len(rows), dtype=bool)
        free[grammar_js] = False
        bits[free] = ALLOW_ALL
    tail[grammar_js] = 0
    return todo


def apply_token_bitmask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """logits[r, v] = -inf where token v is not allowed in row r; in place, no host sync."""
    vocab = logits.shape[1]
    rows, words = mask.bits.shape
    covered = min(vocab, 32 * words)
    shifts = torch.arange(32, dtype=torch.int32, device=mask.bits.device)
    bits = (mask.bits[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = bits.view(rows, -1)[:, :covered].bool()
    logits[:, :covered].masked_fill_(~allowed, float("-inf"))
    if covered < vocab:
        logits[:, covered:].masked_fill_((mask.tail == 0)[:, None], float("-inf"))
    return logits
