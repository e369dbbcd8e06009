"""Speculative decoding's counters (vLLM's SpecDecodingStats): cumulative over the engine's life,
counted at commit from the step's one download, and sent to the front end in `EngineStats`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # speculative rows that verified at least one draft
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted
    # [K]: drafts accepted at each draft position (position 0 is the first draft)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, k: int) -> SpecDecodingStats:
        return cls(num_accepted_tokens_per_pos=[0] * k)

    def observe(self, num_draft: np.ndarray, num_accepted: np.ndarray) -> None:
        """A step's speculative rows (int arrays, one entry per row): row i verified
        `num_draft[i]` drafts and kept the first `num_accepted[i]`. Rows that verified none are
        not counted (vLLM counts only rows with drafts)."""
        live = num_draft > 0
        accepted = num_accepted[live]
        self.num_drafts += int(live.sum())
        self.num_draft_tokens += int(num_draft[live].sum())
        self.num_accepted_tokens += int(accepted.sum())
        per_pos = self.num_accepted_tokens_per_pos
        # rows accepting more than j drafts count at position j
        at_least = np.bincount(accepted, minlength=len(per_pos) + 1)[::-1].cumsum()[::-1]
        for j in range(len(per_pos)):
            per_pos[j] += int(at_least[j + 1])

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified draft run: 1 + accepted / drafts (1.0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Per draft position: the share of draft runs whose draft there was accepted."""
        n = self.num_drafts
        return [a / n if n else 0.0 for a in self.num_accepted_tokens_per_pos]

    def since(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts added after `earlier` (a snapshot of the same counters)."""
        return SpecDecodingStats(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [a - b for a, b in zip(self.num_accepted_tokens_per_pos,
                                   earlier.num_accepted_tokens_per_pos)])


def acceptance_summary(stats: SpecDecodingStats | None) -> dict[str, object]:
    """A benchmark's speculative fields (all None without speculation): vLLM's counts, the mean
    acceptance length and the acceptance rate of each draft position."""
    if stats is None:
        return {"spec_decode_num_drafts": None, "spec_decode_num_draft_tokens": None,
                "spec_decode_num_accepted_tokens": None, "spec_mean_acceptance_length": None,
                "spec_acceptance_rate_per_pos": None}
    return {"spec_decode_num_drafts": stats.num_drafts,
            "spec_decode_num_draft_tokens": stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
            "spec_mean_acceptance_length": stats.mean_acceptance_length,
            "spec_acceptance_rate_per_pos": stats.acceptance_rate_per_pos}
