"""The interfaces between the pipeline, the model runner and the grammar step.

`StepRunner` is what `photon.engine.pipeline.Pipeline` drives, one step at a time:
prepare(plan) -> launch -> sample -> (sync) -> wait, then the step's sampled ids and prompt scores.
`ModelRunner` implements it on a device; tests drive the pipeline with a fake one.
`MaskSource` is what the runner asks, while it samples a step, for that step's grammar masks
(`photon.structured.step.GrammarStep` implements it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from photon.core.step import CommittedToken, PromptScores, StepPlan
    from photon.structured.bitmask import TokenMask


@dataclass(frozen=True, slots=True)
class StepMasks:
    """A step's next-token masks in page-locked host memory, one row per sampling row, and the
    fence to wait for before copying them: (host address of a word, value), the GPU waiting for
    the word (None: the masks are complete already)."""

    mask: TokenMask
    fence: tuple[int, int] | None


class MaskSource(Protocol):
    def masks_for(self, step: int, device_wait: bool) -> StepMasks | None:
        """The masks of step `step` (None: it has no grammar row). `device_wait`: the runner can
        make the GPU wait for a fence; otherwise the masks are complete when returned."""


class StepRunner(Protocol):
    def prepare(self, plan: StepPlan) -> Any | None:
        """Apply the plan's table changes, build and stage its inputs (host only); None for an
        empty plan."""

    def launch(self, prepared: Any) -> Any:
        """Enqueue the staged inputs' upload and the forward; returns the step's handle."""

    def sample(self, handle: Any) -> None:
        """Enqueue the sampling of the step and the download of its tokens."""

    def sync(self, handle: Any) -> None:
        """Block until the step's tokens are on the host."""

    def wait(self, handle: Any) -> list[list[CommittedToken]]:
        """sync, then the committed tokens of each planned row: none for rows that do not
        sample, one for plain sampling rows, 1 to K + 1 for speculative rows."""

    def sampled_ids(self, handle: Any) -> np.ndarray:
        """Every sampling row's token, in sampling order (after `wait`): one per plain row,
        K_eff + 1 per speculative row (its emitted tokens, then negative entries). The grammar's
        masks follow the same rows."""

    def prompt_scores(self, handle: Any) -> list[PromptScores]:
        """The step's prompt logprobs (after `wait`)."""
