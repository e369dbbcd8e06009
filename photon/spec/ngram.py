"""N-gram (prompt lookup) proposer on the device: no model, the request's own tokens.

For each row with known tokens t[0..S) (prompt + output, the last sampled token included), the
proposer finds the longest n in [prompt_lookup_min, prompt_lookup_max] such that the last n tokens
t[S-n..S) also occur ending at an earlier position e <= S-2 (occurrences may overlap the suffix),
takes the most recent such occurrence, and proposes the tokens that followed it,
t[e+1 .. e+1+K), cut at the end of the known tokens and at max_model_len. No match: num_draft = 0.
(vLLM picks the earliest occurrence of the longest match; the most recent one follows the
request's latest context. The choice only changes which tokens are proposed: verification keeps
the output distribution whatever the proposals are.)

Vectorised over a window of the last W tokens of each row (W = the whole pool row unless
`search_window` bounds it): prompt_lookup_max shifted compares of [B, W], no host sync, shapes
from (B, K, L) only. On CUDA one Triton launch does the same (photon.kernels.ngram); these torch
ops are the CPU path and its oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from photon.kernels import has_triton
from photon.spec.config import SpeculativeConfig
from photon.spec.proposer import PROPOSERS, Proposal, ProposeContext


def _window(ctx: ProposeContext, width: int) -> tuple[Tensor, Tensor]:
    """([B, W] int64 tokens, [B, W] bool valid): row b's positions S-W .. S-1, right-aligned."""
    offsets = torch.arange(width, device=ctx.seq_lens.device) - width
    pos = ctx.seq_lens[:, None] + offsets[None, :]  # [B, W], the last column is S-1
    valid = pos >= 0
    tokens = ctx.token_pool[ctx.pool_rows[:, None], pos.clamp(min=0)].long()
    return tokens, valid


def _match_lengths(tokens: Tensor, valid: Tensor, max_n: int) -> Tensor:
    """[B, W] int64: for each end column e, the number of i < max_n with tokens[e - i] ==
    tokens[W-1 - i] for all of 0..i (the suffix match length ending at e, capped at max_n)."""
    width = tokens.shape[1]
    run = torch.ones_like(valid)
    length = torch.zeros(tokens.shape, dtype=torch.int64, device=tokens.device)
    for i in range(min(max_n, width)):
        shifted = F.pad(tokens, (i, 0))[:, :width]  # shifted[:, e] = tokens[:, e - i]
        ok = F.pad(valid, (i, 0))[:, :width]
        # The suffix token i back must itself be known (a row shorter than the n-gram).
        suffix_known = valid[:, width - 1 - i:width - i]
        run = run & ok & suffix_known & (shifted == tokens[:, width - 1 - i:width - i])
        length += run
    return length


def propose_ngram(ctx: ProposeContext, min_n: int, max_n: int, max_model_len: int,
                  search_window: int | None = None, fused: bool | None = None) -> Proposal:
    """The n-gram proposals of the module docstring for every row of `ctx`. fused=None runs the
    Triton kernel (photon.kernels.ngram) as `ctx.fused` says (None: on CUDA when triton imports),
    the torch ops otherwise."""
    pool_len = ctx.token_pool.shape[1]
    width = min(search_window or pool_len, pool_len)
    fused = next((f for f in (fused, ctx.fused) if f is not None),
                 ctx.token_pool.is_cuda and has_triton())
    if fused:
        from photon.kernels import ngram  # imports triton: only when fused

        draft, num = ngram.propose(ctx.token_pool, ctx.pool_rows, ctx.seq_lens, ctx.k, min_n,
                                   max_n, max_model_len, width)
        return Proposal(draft, num, None)
    return _propose_torch(ctx, min_n, max_n, max_model_len, width)


def _propose_torch(ctx: ProposeContext, min_n: int, max_n: int, max_model_len: int,
                   width: int) -> Proposal:
    tokens, valid = _window(ctx, width)
    length = _match_lengths(tokens, valid, max_n)
    cols = torch.arange(width, device=tokens.device)
    # An occurrence must end before the last token (something follows it) and be >= min_n long;
    # the score prefers the longer match, then the later end.
    eligible = (length >= min_n) & (cols < width - 1)[None, :]
    score = torch.where(eligible, length * width + cols, torch.full_like(length, -1))
    best, end = score.max(dim=1)
    known_after = (width - 1 - end).clamp(min=0)  # tokens after the occurrence's end
    room = (max_model_len - ctx.seq_lens).clamp(min=0)
    num = torch.minimum(torch.minimum(known_after, room), torch.full_like(room, ctx.k))
    num = torch.where(best >= 0, num, torch.zeros_like(num))
    j = torch.arange(ctx.k, device=tokens.device)
    src = (end[:, None] + 1 + j[None, :]).clamp(max=width - 1)
    draft = tokens.gather(1, src)
    draft = torch.where(j[None, :] < num[:, None], draft, torch.zeros_like(draft))
    return Proposal(draft, num.to(torch.int32), None)


@PROPOSERS.register("ngram")
class NgramProposer:
    """Prompt lookup: `SpeculativeConfig(method="ngram", ...)`. `search_window` bounds how many
    of each row's latest tokens are searched (None: the whole row)."""

    name: str
    capturable = True

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 search_window: int | None = None) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len
        self.search_window = search_window

    def propose(self, ctx: ProposeContext) -> Proposal:
        return propose_ngram(ctx, self.min_n, self.max_n, self.max_model_len, self.search_window)
