"""A launched step's handle and what commit reads from it once its wait is done.

`PreparedStep` is a step staged into its slot (prepare), `StepHandle` the launched step
(launch, sample); after the commit's sync the functions here read the slot's host buffers into
Python values: each row's committed tokens (one per plain sampling row, 1 to K + 1 per
speculative row), every sampling row's token (the grammar's accepts) and the
prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from photon.core.inputs import StepInputs
from photon.core.step import CommittedToken, PromptScores, ScheduledRow
from photon.lora.worker import StagedLoad
from photon.worker.draft_lag import FillChunk
from photon.worker.inputs import HostStep
from photon.worker.probe import StepMarks
from photon.worker.slots import StepSlot
from photon.worker.spec_graphs import GraphKey

if TYPE_CHECKING:
    from photon.worker.spec_step import SpecDecoder


@dataclass
class PreparedStep:
    slot: StepSlot
    rows: list[ScheduledRow]
    host: HostStep
    dev: StepInputs[torch.Tensor]  # device views of the staged inputs (valid after the upload)
    graph_key: GraphKey | None
    step: int  # the plan's step number
    propose: bool  # the plan's: propose drafts after sampling
    lora_loads: list[StagedLoad] = field(default_factory=list)  # into slots before the forward
    # The draft's forward over positions earlier steps skipped, before this step's (draft_lag)
    draft_fill: list[FillChunk] = field(default_factory=list)


@dataclass
class StepHandle:
    slot: StepSlot
    rows: list[ScheduledRow]
    host: HostStep
    dev: StepInputs[torch.Tensor]
    logits: torch.Tensor | None
    step: int
    propose: bool
    num_sampled: int = 0  # rows that sample
    max_logprobs: int = -1
    marks: StepMarks | None = None  # set only while a StepProbe is attached (benchmarks)
    # A speculative graph's step whose logits sample() computes (or its sampling graph does):
    # the graph's key and its output (the hidden states); None: `logits` as computed at launch
    deferred: tuple[GraphKey, torch.Tensor] | None = None


def committed_tokens(h: StepHandle, spec: SpecDecoder | None) -> list[list[CommittedToken]]:
    """Each row's committed tokens (and logprobs, the step's most alternatives) from the slot's
    host buffers (after the step's sync); `spec` counts the speculative rows' acceptances."""
    result: list[list[CommittedToken]] = [[] for _ in h.rows]
    n, k = h.host.num_virtual, h.max_logprobs
    if n == 0:
        return result
    host = h.slot.output_views(n, max(k, 0), host=True)
    widths = h.host.widths
    if widths is not None:
        spec.count(host.tokens.numpy(), widths)
    tokens = host.tokens.tolist()
    if k >= 0:
        lps, ranks = host.logprob.tolist(), host.ranks.tolist()
        top_ids, top_lps = host.topk_ids.tolist(), host.topk_lp.tolist()
    rows = h.host.sample_rows
    if widths is None and k < 0:  # the common step: one token per row, no logprobs
        for i, t in zip(rows, tokens):
            if t >= 0:
                result[i] = [CommittedToken(t)]
        return result
    at = 0
    for j, i in enumerate(rows):
        end = at + (1 if widths is None else widths[j])
        result[i] = [CommittedToken(tokens[v]) if k < 0 else
                     CommittedToken(tokens[v], lps[v], ranks[v], top_ids[v], top_lps[v])
                     for v in range(at, end) if tokens[v] >= 0]
        at = end
    return result


def sampled_tokens(h: StepHandle) -> np.ndarray:
    """Every sampling row's token in sampling order, K_eff + 1 per speculative row (its emitted
    tokens, then -1 and NO_DRAFT): the grammar's accepts. A view of the slot's host buffer: read
    it before the slot's next step is staged."""
    return h.slot.out_i_host[:h.host.num_virtual].numpy()

def prompt_scores(h: StepHandle) -> list[PromptScores]:
    """Step `h`'s prompt logprobs as Python values (after its wait: no further sync)."""
    spans = h.host.prompt_spans
    if not spans:
        return []
    total = sum(s.count for s in spans)
    host = h.slot.prompt_views(total, max(h.host.prompt_k, 0), host=True)
    lps, ranks = host.logprob.tolist(), host.ranks.tolist()
    top_ids, top_lps = host.topk_ids.tolist(), host.topk_lp.tolist()
    scores, at = [], 0
    for s in spans:
        end = at + s.count
        scores.append(PromptScores(
            h.rows[s.row].req_index, s.first, lps[at:end], ranks[at:end],
            [ids[:s.k] for ids in top_ids[at:end]], [v[:s.k] for v in top_lps[at:end]]))
        at = end
    return scores
