"""The model runner's speculative decoding: device-resolved positions, verification, proposals.

Invariant: the device knows each request's length, `dev_len[req_index]` (committed tokens plus
those accepted by steps not yet committed), and the host never reads it. Every sampling row of a
step that proposes or has speculative rows sets it (plain rows: seq_len + 1, `advance_plain`;
speculative rows: dev_len + accepted + 1, `advance`). A step of plain rows that proposes nothing
(the adaptive switch off) leaves it stale: its only readers are the proposal after a proposing
step (which set it first) and speculative rows, which follow a proposing row or a speculative
row in flight (either set it). After each sampling row of a speculative request in a step that proposes
(`StepPlan.propose`: the switch chose K_eff > 0) the proposer writes its next drafts into the
token pool at dev_len .. dev_len + K - 1 (`num_draft[req_index]` of them are proposals). `num_draft` is read
only by a row verifying drafts, which the scheduler plans only after such a proposing row (a
row verifying none clamps it to 0). A speculative row
(photon.core.step.ScheduledRow) then queries positions dev_len - 1 .. dev_len + K - 1: its last
known token and the drafts, all read from the pool. The host stages placeholders for them and
`resolve` fills them at launch, so step t+1 is launched before step t's accepted counts reach
the host, with no host sync.

Positions a zombie row resolves past max_model_len are clamped (model inputs) or sent to the
null block (KV slots): such rows' tokens are dropped at commit.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from photon.core.inputs import StepInputs
from photon.kernels import has_triton
from photon.spec.config import SpeculativeConfig
from photon.spec.proposer import ProposeContext, build_proposer
from photon.spec.rejection import verify
from photon.spec.stats import SpecDecodingStats
from photon.structured.bitmask import TokenMask
from photon.worker.sampler import GREEDY_EPS, Sampler, SamplingBatch

NO_DRAFT = -2  # a speculative row's sampling row past its drafts (-1: a draft not reached)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, num_rows: int,
                 pool_width: int, block_size: int, device: torch.device,
                 fused: bool | None = None) -> None:
        self.k = config.k
        # fused=None: the Triton kernels of photon.kernels.spec_step on CUDA when triton imports.
        self.fused = fused if fused is not None else device.type == "cuda" and has_triton()
        self.proposer = build_proposer(config, max_model_len)
        self.max_model_len = max_model_len
        self.pool_width = pool_width
        self.block_size = block_size
        self.dev_len = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.num_draft = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.counters = SpecDecodingStats.empty(self.k)  # committed steps (metrics)
        self._j = torch.arange(self.k + 1, device=device)

    # ---- launch ---------------------------------------------------------------------------
    def resolve(self, dev: StepInputs[Tensor], num_rows: int, k: int) -> None:
        """Fill the speculative rows' positions, input pool entries, KV slots and seq_lens, and
        their sampling rows' counters, lengths and pool entries, from `dev_len` (`k`: the
        step's K_eff, the drafts each of its speculative rows verifies; `num_rows`: the staged
        rows, a graph's padding rows included)."""
        rows, req = dev.spec_rows, dev.spec_reqs
        if rows.numel() == 0:  # a shape: no sync
            return
        if self.fused:
            from photon.kernels import spec_step  # imports triton: only when fused

            spec_step.resolve(self.dev_len, dev, num_rows, k, self.pool_width, self.block_size,
                              self.max_model_len)
            return
        w, bs = self.pool_width, self.block_size
        d = self.dev_len[req]
        pos = d[:, None] - 1 + self._j[None, :k + 1]  # [S, K_eff+1]
        tok = (dev.query_start_loc[rows][:, None] + self._j[None, :k + 1]).reshape(-1)
        base = req[:, None] * w
        dev.positions[tok] = pos.clamp(max=self.max_model_len - 1).reshape(-1)
        dev.pool_idx[tok] = (base + pos.clamp(max=w - 1)).reshape(-1)
        tables = dev.block_tables.view(num_rows, -1)[rows]
        width = tables.shape[1]
        block = tables.gather(1, (pos // bs).clamp(max=width - 1))
        block = torch.where(pos // bs < width, block, torch.zeros_like(block))
        dev.slot_mapping[tok] = (block * bs + pos % bs).reshape(-1)
        dev.seq_lens[rows] = d + k
        v = self._vrows(dev, k)
        nxt = (pos + 1).reshape(-1)  # the position of the token each sampling row decides
        dev.counters[v] = nxt - dev.prompt_lens[v]
        dev.sample_seq_lens[v] = nxt
        dev.sample_pool_idx[v] = (base + (pos + 1).clamp(max=w - 1)).reshape(-1)

    def _vrows(self, dev: StepInputs[Tensor], k: int) -> Tensor:
        """[S * (k+1)] the sampling rows of the speculative rows, row by row."""
        return (dev.spec_vrows[:, None] + self._j[None, :k + 1]).reshape(-1)

    # ---- sample ---------------------------------------------------------------------------
    def sample(self, sampler: Sampler, logits: Tensor, batch: SamplingBatch,
               dev: StepInputs[Tensor], pool: Tensor, k: int,
               only_spec: bool = False) -> tuple[Tensor, Tensor | None]:
        """([R] tokens, raw log-softmax or None) of every sampling row: plain rows draw, the
        K + 1 rows of a speculative row hold its verified tokens, then -1 up to its last draft's
        position and NO_DRAFT past it. `only_spec` (the host knows it): every sampling row is a
        speculative row's, in row order, so the scores are verified in place and nothing draws
        (the draw and the copy of the scores would cost a pass over [R, V] each)."""
        raw, scores, owned = sampler.process(logits, batch, overwrite=True)
        num_spec = dev.spec_rows.shape[0]
        mask = batch.token_bitmask
        if only_spec:
            v, spec_scores, tokens = None, scores, None
            if mask is not None:
                sampler.apply_mask(spec_scores, mask)
        else:
            v = self._vrows(dev, k)
            spec_scores = scores[v]  # a copy: draw may mask scores
            if mask is not None:  # grammar rows verify on the masked distribution everywhere
                sampler.apply_mask(spec_scores, TokenMask(mask.bits[v], mask.tail[v]))
            tokens = sampler.draw(scores, batch, owned)
        spec_scores = spec_scores.view(num_spec, k + 1, -1)
        verified = (self._verify_fused(spec_scores, batch, dev, pool, k, only_spec) if self.fused
                    else self._verify(spec_scores, batch, dev, pool, k))
        if tokens is None:
            return verified, raw
        tokens[v] = verified
        return tokens, raw

    def _verify(self, scores: Tensor, batch: SamplingBatch, dev: StepInputs[Tensor],
                pool: Tensor, k: int) -> Tensor:
        """[S * (k+1)] the speculative rows' verified tokens (scores [S, k+1, V]), NO_DRAFT
        past each row's drafts; torch ops (the fused path's oracle)."""
        req = dev.spec_reqs
        d = self.dev_len[req]
        drafts = pool.view(-1)[req[:, None] * self.pool_width
                               + (d[:, None] + self._j[None, :k]).clamp(
                                   max=self.pool_width - 1)].long()
        num_draft = self.num_draft[req].clamp(max=k)  # K_eff < K: the first K_eff drafts
        out = verify(scores, drafts, num_draft, None, _first_rows(batch, dev.spec_vrows))
        # Positions past the row's drafts (never emitted) carry NO_DRAFT instead of -1: the
        # commit counts the row's drafts from the one download it already makes.
        no_draft = self._j[None, :k + 1] > num_draft[:, None]
        return torch.where(no_draft, NO_DRAFT, out.tokens).reshape(-1)

    def _verify_fused(self, scores: Tensor, batch: SamplingBatch, dev: StepInputs[Tensor],
                      pool: Tensor, k: int, only_spec: bool) -> Tensor:
        """`_verify` in two launches: the drafts gathered from the pool, then the verification
        kernel, which writes NO_DRAFT itself and, in a step of speculative rows only, reads
        each row's parameters from its first sampling row's entry (no gathers)."""
        from photon.kernels import spec_step, spec_verify  # import triton: only when fused

        drafts, num_draft = spec_step.gather_drafts(pool, self.dev_len, self.num_draft,
                                                    dev.spec_reqs, k, self.pool_width)
        params = batch if only_spec else _first_rows(batch, dev.spec_vrows)
        tokens, _ = spec_verify.verify(scores, drafts, num_draft, None, params,
                                       greedy_eps=GREEDY_EPS, per_position=only_spec,
                                       past_drafts=NO_DRAFT)
        return tokens.view(-1)

    def advance_plain(self, dev: StepInputs[Tensor]) -> None:
        """After a step without speculative rows (its tokens are in the pool): the new lengths.
        Each sampling row added one token at seq_len."""
        self.dev_len[dev.pool_rows] = dev.sample_seq_lens + 1

    def advance(self, tokens: Tensor, dev: StepInputs[Tensor], pool: Tensor, k: int,
                only_spec: bool = False) -> None:
        """After a step's draw with speculative rows: its tokens into the pool, the new
        lengths (`k`: the step's K_eff; `only_spec`: every sampling row is a speculative
        row's, in row order, one launch when fused)."""
        if only_spec and self.fused:
            from photon.kernels import spec_step  # imports triton: only when fused

            spec_step.advance(tokens, pool, self.dev_len, dev, k)
            return
        flat = pool.view(-1)
        idx = dev.sample_pool_idx
        keep = tokens >= 0
        flat[idx] = torch.where(keep, tokens, flat[idx].long()).to(torch.int32)
        # Row r's new length: the largest (position + 1) of its sampling rows that kept a token.
        ends = torch.where(keep, dev.sample_seq_lens + 1, torch.zeros_like(idx))
        self.dev_len.scatter_reduce_(0, dev.pool_rows, ends, "amax", include_self=False)

    def propose(self, req: Tensor, pool: Tensor) -> None:
        """The next drafts of requests `req` into the pool at dev_len .. dev_len + K - 1."""
        if req.numel() == 0:
            return
        lens = self.dev_len[req]
        # A zombie row that verified drafts past the end has a device length beyond
        # max_model_len (its tokens are dropped at commit): the proposer reads positions
        # < its length from the pool row (max_model_len + 1 wide) and proposes nothing for a row
        # with no room left, so such a row is shown at max_model_len.
        seen = lens.clamp(max=self.max_model_len)
        prop = self.proposer.propose(ProposeContext(pool, req, seen, self.k, self.fused))
        if self.fused:
            from photon.kernels import spec_step  # imports triton: only when fused

            spec_step.write_proposals(pool, self.dev_len, self.num_draft, req, prop.draft_ids,
                                      prop.num_draft, self.k, self.pool_width)
            return
        num = prop.num_draft.long()
        j = self._j[None, :self.k]
        idx = req[:, None] * self.pool_width + (lens[:, None] + j).clamp(max=self.pool_width - 1)
        flat = pool.view(-1)
        flat[idx] = torch.where(j < num[:, None], prop.draft_ids, flat[idx].long()).to(
            torch.int32)
        self.num_draft[req] = num

    def count(self, tokens: np.ndarray, widths: list[int]) -> None:
        """Host counters of a committed step (its downloaded tokens, sampling-row widths): a
        speculative row of K_eff + 1 emitted `n >= 1` tokens (n - 1 accepted drafts) and has a
        NO_DRAFT entry per draft position it did not propose. Vectorized: it runs for every
        row of every speculative step."""
        w = np.asarray(widths)
        starts = np.concatenate(([0], np.cumsum(w)[:-1]))
        no_draft = np.add.reduceat(tokens == NO_DRAFT, starts)
        emitted = np.add.reduceat(tokens >= 0, starts)
        spec = w > 1
        self.counters.observe((w - 1 - no_draft)[spec], (emitted - 1)[spec])


def _first_rows(batch: SamplingBatch, v0: Tensor) -> SamplingBatch:
    """The parameters of each speculative row: those of its first sampling row (v0)."""
    return replace(batch, temperature=batch.temperature[v0], top_k=batch.top_k[v0],
                   top_p=batch.top_p[v0], min_p=batch.min_p[v0], keys=batch.keys[v0],
                   counters=batch.counters[v0], token_bitmask=None)
