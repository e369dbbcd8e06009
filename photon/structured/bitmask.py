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
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from photon.engine.scheduler import ScheduledRow
    from photon.structured.backend import GrammarBackend

ALLOW_ALL = -1


@dataclass
class TokenMask:
    bits: torch.Tensor  # [R, W] int32
    tail: torch.Tensor  # [R] int32

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
    return TokenMask(bits, flat[tail:tail + rows])


def fill_bitmasks(rows: list[ScheduledRow], mask: TokenMask, backend: GrammarBackend) -> None:
    """Row j of `mask` for the j-th sampling row, from the matcher state committed so far: every
    output before the row's `out_index` has been accepted. The backend fills the grammar rows in
    one call."""
    todo: list[int] = []
    for j, row in enumerate(rows):
        req = row.request
        grammar = req.grammar
        if grammar is None or req.finalized or grammar.is_terminated():
            continue
        assert grammar.num_accepted == row.out_index, \
            "grammar mask built before the previous token was committed"
        todo.append(j)
    mask.tail.fill_(ALLOW_ALL)
    if len(todo) < len(rows):
        free = torch.ones(len(rows), dtype=torch.bool)
        free[todo] = False
        mask.bits[free] = ALLOW_ALL
    if todo:
        mask.tail[todo] = 0
        backend.fill_bitmasks([rows[j].request.grammar.matcher for j in todo], mask.bits, todo)


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
