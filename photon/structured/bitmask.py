"""Next-token bitmasks: filled on the host at finalize(t+1), applied on the device in the sampler.

Packing (xgrammar's): int32 words, bit `v % 32` of word `v // 32` set = token v allowed; -1 (all
bits) = no constraint. Rows without a grammar, and zombie rows (finalized at commit(t)), get -1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from photon.engine.scheduler import ScheduledRow
    from photon.structured.rows import GrammarRowPool

ALLOW_ALL = -1


def fill_bitmasks(rows: list[ScheduledRow], bitmask: torch.Tensor, pool: GrammarRowPool) -> None:
    """Row j of `bitmask` (CPU int32 [R, W]) for the j-th sampling row, from the matcher state
    committed so far: every output before the row's `out_index` has been accepted. The grammar
    rows' fills run on `pool`'s threads."""
    todo: list[int] = []
    for j, row in enumerate(rows):
        req = row.request
        grammar = req.grammar
        if grammar is None or req.finalized or grammar.is_terminated():
            bitmask[j].fill_(ALLOW_ALL)
            continue
        assert len(req.output_token_ids) == row.out_index, \
            "grammar mask built before the previous token was committed"
        todo.append(j)

    def fill(k: int) -> None:
        j = todo[k]
        rows[j].request.grammar.fill_bitmask(bitmask, j)

    pool.run(fill, len(todo))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits[r, v] = -inf where bit v of row r is clear; in place, no host sync."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
    return logits.masked_fill_(~allowed, float("-inf"))
