"""Next-token masks: filled on the host by a step's grammar job, applied on the device in the
sampler.

Layout of one step's masks for R sampling rows, packed in one flat int32 buffer (one H2D copy):
  bits [R, W]  the backend's packing (xgrammar's): bit `v % 32` of word `v // 32` set = token v
               allowed, for the ids the backend covers, v < 32 * W (W = `mask_words`, the
               tokenizer's ids; it may be narrower than the model's padded vocabulary)
  tail [R]     whether ids v >= 32 * W are allowed: 0 under a grammar, -1 without one; it starts
               on a 16-byte boundary (Triton specializes kernels on pointer alignment, so an
               offset that moved with R would compile a second variant mid-run)
Rows without a grammar, zombie rows (finished at commit(t)) and terminated grammars get all bits
and the tail set: no constraint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

ALLOW_ALL = -1


@dataclass
class TokenMask:
    bits: torch.Tensor  # [R, W] int32
    tail: torch.Tensor  # [R] int32
    flat: torch.Tensor | None = None  # both, and the padding between them: one copy moves all
    _arrays: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """numpy views of (bits, tail) of a host mask."""
        if self._arrays is None:
            self._arrays = (self.bits.numpy(), self.tail.numpy())
        return self._arrays


def _tail_offset(rows: int, words: int) -> int:
    return (rows * words + 3) // 4 * 4


def mask_numel(rows: int, words: int) -> int:
    return _tail_offset(rows, words) + rows


def mask_views(flat: torch.Tensor, rows: int, words: int) -> TokenMask:
    """The layout above over the head of a flat int32 buffer (host or device)."""
    bits = flat[:rows * words].view(rows, words)
    tail = _tail_offset(rows, words)
    return TokenMask(bits, flat[tail:tail + rows], flat[:tail + rows])


class MaskViews:
    """`mask_views` of a few fixed buffers, built once per (buffer, rows): a grammar step takes
    two (host and device), and building views costs more than the rest of its bookkeeping."""

    def __init__(self, words: int) -> None:
        self.words = words
        self._views: dict[tuple[int, int], TokenMask] = {}

    def __call__(self, flat: torch.Tensor, rows: int) -> TokenMask:
        key = (flat.data_ptr(), rows)  # a cached view keeps its buffer alive: the key stays unique
        mask = self._views.get(key)
        if mask is None:
            mask = self._views[key] = mask_views(flat, rows, self.words)
        return mask


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
