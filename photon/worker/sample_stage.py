"""The runner's sample stage: grammar masks, the sampling batch, the draw or the speculative
verification, the tokens into the token pool and the slot, the next proposals, the download.

It samples step t+1 after the commit of t (the grammar masks of t+1 need t's accepted tokens) and
writes the tokens where forward t+2 reads them; steps of a speculative graph whose sampling has a
graph of its own (photon.worker.spec_sample_graphs) replay it instead. The runner owns it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from photon.core.runner import MaskSource
from photon.structured.bitmask import MaskViews, TokenMask
from photon.worker.cuda_graph import staged_rows
from photon.worker.draft_runner import DraftRunner
from photon.worker.probe import StepProbe
from photon.worker.sampler import Sampler, step_batch, token_logprobs
from photon.worker.slots import Streams
from photon.worker.spec_sample_graphs import SpecSampleGraphs
from photon.worker.spec_step import SpecDecoder
from photon.worker.step_results import StepHandle


class SampleStage:
    def __init__(self, sampler: Sampler, spec: SpecDecoder | None, draft: DraftRunner | None,
                 token_pool: torch.Tensor, streams: Streams, masks: MaskSource | None,
                 mask_views: MaskViews, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 first_rank: bool) -> None:
        self.sampler = sampler
        self.spec = spec
        self.draft = draft
        self.token_pool = token_pool
        self.streams = streams
        self.masks = masks
        self.mask_views = mask_views
        self.compute_logits = compute_logits
        self.first_rank = first_rank  # only rank 0's tokens go to the host
        self.graphs: SpecSampleGraphs | None = None  # set once the runner captured them

    def _token_bitmask(self, h: StepHandle) -> TokenMask | None:
        """The step's grammar masks on the device, their H2D enqueued (on CUDA with the grammar
        worker fenced on its job: the GPU waits for it, not the engine thread). None for steps
        without a grammar row: plain steps pay one dictionary lookup."""
        if self.masks is None:
            return None
        masks = self.masks.masks_for(h.step, self.streams.word_wait is not None)
        if masks is None:
            return None
        return self.mask_views(h.slot.upload_mask(self.streams, masks.mask, masks.fence),
                               h.host.num_virtual)

    @torch.inference_mode()
    def sample(self, h: StepHandle, probe: StepProbe | None) -> None:
        """Sample step t+1 with the state committed at t; write tokens where forward t+2 reads."""
        if h.logits is None and h.deferred is None:
            # Nothing to sample, but the fence must still be recorded: commit(t) waiting on it is
            # what makes the slot's staging buffers reusable at t+2.
            h.slot.download(self.streams, 0, -1)
            return
        if h.marks is not None:
            probe.mark(h.marks, "smp_start")
        mask = self._token_bitmask(h)
        if h.deferred is not None:
            if mask is None and self._sample_graphed(h, probe):
                return
            h.logits = self.compute_logits(h.deferred[1])
        batch = step_batch(h.dev, h.host.flags, self.token_pool, mask)
        k = h.max_logprobs
        if h.host.widths is None:
            out = self.sampler(h.logits, batch, overwrite=True)
            tokens, lps = out.token_ids, (out.logprobs, out.ranks, out.topk_ids,
                                          out.topk_logprobs)
        else:
            tokens, raw = self.spec.sample(self.sampler, h.logits, batch, h.dev, self.token_pool,
                                           h.host.spec_k, h.host.only_spec)
            lps = token_logprobs(raw, tokens.clamp(min=0), k) if raw is not None else None
        rows = h.host.num_virtual
        views = h.slot.output_views(rows, max(k, 0))
        views.tokens.copy_(tokens)
        if k >= 0:
            views.logprob.copy_(lps[0])
            views.ranks.copy_(lps[1])
            if k > 0:
                views.topk_ids.copy_(lps[2])
                views.topk_lp.copy_(lps[3])
        self._advance(h, tokens)
        if h.marks is not None:
            probe.mark(h.marks, "smp_end")
        # The other ranks sampled the same tokens into their pools; only rank 0's reach the host.
        h.slot.download(self.streams, rows if self.first_rank else 0, k)

    def _sample_graphed(self, h: StepHandle, probe: StepProbe | None) -> bool:
        """The step's sampling by its sampling graph, if it has one (False: sample eagerly)."""
        if self.graphs is None:
            return False
        key = self.graphs.key(h.deferred[0], h.host, len(h.rows), h.propose,
                              h.host.inputs.propose_reqs.size)
        if key is None:
            return False
        rows = h.host.num_virtual
        h.slot.output_views(rows, 0).tokens.copy_(self.graphs.run(key, h.dev, len(h.rows)))
        if h.propose and not key.propose:  # a proposer the graph does not hold
            self._bind_draft(h)
            self.spec.propose(h.dev.propose_reqs, self.token_pool)
        if h.marks is not None:
            probe.mark(h.marks, "smp_end")
        h.slot.download(self.streams, rows, -1)
        return True

    def _advance(self, h: StepHandle, tokens: torch.Tensor) -> None:
        """The step's tokens into the pool where the next step reads them. With speculation:
        the device lengths, then the next drafts when the plan says so (its K_eff > 0: a step
        verifying none, the adaptive switch's choice while the batch stays large, predicts the
        next one, so it skips the proposer's cost). A step without speculative rows (plain
        rows of speculative requests included) takes the plain path; one that proposes nothing
        either leaves the device lengths alone (photon.worker.spec_step: nothing reads them
        before the request's next proposing step sets them)."""
        spec = self.spec
        if spec is not None and h.host.widths is not None:
            spec.advance(tokens, h.dev, self.token_pool, h.host.spec_k, h.host.only_spec)
        else:
            self.token_pool.view(-1)[h.dev.sample_pool_idx] = tokens.to(torch.int32)
            if spec is not None and h.propose:
                spec.advance_plain(h.dev)
        if spec is not None and h.propose:
            self._bind_draft(h)
            spec.propose(h.dev.propose_reqs, self.token_pool)

    def _bind_draft(self, h: StepHandle) -> None:
        """The draft model's step for the requests that propose after step `h`."""
        num = h.host.inputs.propose_reqs.size
        if self.draft is not None and num:
            self.spec.proposer.bind(self.draft.decode(h.dev, staged_rows(h.dev), num))
