"""Lossless verification of draft tokens (rejection sampling; Leviathan et al. 2023, Chen et al.
2023): the emitted tokens follow the target distribution exactly, whatever the proposals.

For row b with target distributions p_0..p_K (the K+1 scored positions, after temperature,
min_p, top_k and top_p) and drafts x_0..x_{n-1} (n = num_draft[b]) drawn from q_j (one-hot when
the proposer gives no draft_probs):
  * x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)), tested as u_j * q_j(x_j) <
    p_j(x_j); verification stops at the first rejection;
  * after a rejection at j, the token emitted at j is drawn from norm(max(0, p_j - q_j)) (from
    p_j if that residual is all zero, which only rounding can cause);
  * when all n drafts are accepted, a bonus token is drawn from p_n.
Greedy rows (temperature < GREEDY_EPS) accept x_j iff it is the argmax of the logits and emit the
argmax: the tokens of non-speculative greedy decoding.

Randomness is the counter-based noise of photon.worker.sampler: position j of row b uses counter
counters[b] + j (the output index of the token it decides), the accept uniform and the draw after
a rejection from their own salted streams (photon.core.sampling.ACCEPT_SALT / RESIDUAL_SALT), and
the bonus draw the plain stream: with no drafts a row draws exactly the token the sampler would.
So a seeded request is reproducible and independent of its batch. No host sync; shapes from
(B, K, V) only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from photon.core.sampling import ACCEPT_SALT, RESIDUAL_SALT
from photon.kernels import has_triton
from photon.worker.sampler import (
    GREEDY_EPS,
    SamplingBatch,
    gumbel_noise,
    noise_bits,
    scale_and_filter,
    uniform_from_bits,
)


@dataclass
class VerifyOutput:
    tokens: Tensor  # [B, K+1] int64: accepted drafts, then the emitted token, then -1
    num_accepted: Tensor  # [B] int32: accepted drafts; row b emits num_accepted[b] + 1 tokens


def salted_keys(keys: Tensor, salt: int) -> Tensor:
    """The keys of an independent noise stream: the high word XORed with `salt` (< 2**31)."""
    return keys.long() ^ (salt << 32)


def accept_uniforms(keys: Tensor, counters: Tensor) -> Tensor:
    """[B, J] float32 u in (0, 1) of the accept test for counters [B, J]."""
    rows, width = counters.shape
    flat_keys = salted_keys(keys, ACCEPT_SALT).repeat_interleave(width)
    bits = noise_bits(flat_keys, counters.reshape(-1), 1)
    return uniform_from_bits(bits).view(rows, width)


def accept_rule(u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
    """Accept with probability min(1, p/q): u < p/q without the division (q may be 0)."""
    return u * q_x < p_x


def _filtered_scores(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """[B, K+1, V] scaled, filtered scores (sampler.scale_and_filter on every position)."""
    rows, width, vocab = logits.shape

    def rep(t: Tensor, on: bool) -> Tensor | None:
        return t.repeat_interleave(width) if on else None

    flat = scale_and_filter(logits.reshape(rows * width, vocab).float(),
                            batch.temperature.repeat_interleave(width),
                            rep(batch.min_p, batch.any_min_p), rep(batch.top_k, batch.any_top_k),
                            rep(batch.top_p, batch.any_top_p))
    return flat.view(rows, width, vocab)


def _num_accepted(ok: Tensor, num_draft: Tensor) -> Tensor:
    """[B] int64: the leading accepted drafts (ok [B, K] per position, cut at num_draft)."""
    j = torch.arange(ok.shape[1], device=ok.device)
    ok = ok & (j[None, :] < num_draft[:, None].long())
    return ok.long().cumprod(dim=1).sum(dim=1)


def _at(t: Tensor, index: Tensor) -> Tensor:
    """t[b, index[b]] for t [B, J, ...]."""
    idx = index.view(-1, 1, *([1] * (t.dim() - 2))).expand(-1, 1, *t.shape[2:])
    return t.gather(1, idx).squeeze(1)


def _assemble(draft_ids: Tensor, accepted: Tensor, emitted: Tensor) -> VerifyOutput:
    rows, k = draft_ids.shape
    j = torch.arange(k + 1, device=draft_ids.device)[None, :]
    padded = F.pad(draft_ids.long(), (0, 1))
    tokens = torch.where(j < accepted[:, None], padded, torch.full_like(padded, -1))
    tokens = torch.where(j == accepted[:, None], emitted[:, None], tokens)
    return VerifyOutput(tokens, accepted.to(torch.int32))


def _draw_after(scores: Tensor, probs: Tensor, draft_ids: Tensor, draft_probs: Tensor | None,
                accepted: Tensor, num_draft: Tensor, batch: SamplingBatch) -> Tensor:
    """[B] the token emitted at position accepted[b]: from the residual after a rejection, else
    the bonus draw from p (the sampler's own draw: same noise, same scores)."""
    vocab = scores.shape[2]
    rejected = accepted < num_draft.long()
    p_a = _at(probs, accepted)
    last = accepted.clamp(max=max(draft_ids.shape[1] - 1, 0))
    if draft_ids.shape[1] == 0:
        q_a = torch.zeros_like(p_a)
    elif draft_probs is None:
        q_a = F.one_hot(_at(draft_ids.long(), last), vocab).to(p_a.dtype)
    else:
        q_a = _at(draft_probs.float(), last)
    residual = (p_a - q_a).clamp(min=0)
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_a)
    score = torch.where(rejected[:, None], residual.log(), _at(scores, accepted))
    keys = torch.where(rejected, salted_keys(batch.keys, RESIDUAL_SALT), batch.keys.long())
    return (score + gumbel_noise(keys, batch.counters.long() + accepted, vocab)).argmax(dim=1)


def verify_torch(target_logits: Tensor, draft_ids: Tensor, num_draft: Tensor,
                 draft_probs: Tensor | None, batch: SamplingBatch) -> VerifyOutput:
    """The torch implementation (CPU and CUDA) of `verify`."""
    rows, width, _ = target_logits.shape
    k = width - 1
    argmax = target_logits.argmax(dim=2)  # [B, K+1]
    greedy_ok = draft_ids.long() == argmax[:, :k]
    if batch.all_greedy:
        accepted = _num_accepted(greedy_ok, num_draft)
        return _assemble(draft_ids, accepted, _at(argmax, accepted))
    scores = _filtered_scores(target_logits, batch)
    probs = torch.softmax(scores, dim=2)
    x = draft_ids.long()[:, :, None]
    p_x = probs[:, :k].gather(2, x).squeeze(2)
    q_x = torch.ones_like(p_x) if draft_probs is None else \
        draft_probs.float().gather(2, x).squeeze(2)
    ctr = batch.counters.long()[:, None] + torch.arange(k, device=p_x.device)[None, :]
    sampled_ok = accept_rule(accept_uniforms(batch.keys, ctr), p_x, q_x)
    greedy = (batch.temperature < GREEDY_EPS)[:, None]
    accepted = _num_accepted(torch.where(greedy, greedy_ok, sampled_ok), num_draft)
    drawn = _draw_after(scores, probs, draft_ids, draft_probs, accepted, num_draft, batch)
    emitted = torch.where(greedy[:, 0], _at(argmax, accepted), drawn)
    return _assemble(draft_ids, accepted, emitted)


def verify(target_logits: Tensor, draft_ids: Tensor, num_draft: Tensor,
           draft_probs: Tensor | None, batch: SamplingBatch,
           fused: bool | None = None) -> VerifyOutput:
    """Verify the drafts of B rows against the target's K+1 scored positions.

    target_logits [B, K+1, V] (position j scores the token after the j-th draft; penalties,
    biases, bans and grammar masks already applied), draft_ids [B, K], num_draft [B],
    draft_probs [B, K, V] or None (deterministic proposals). `batch`: the rows' sampling
    parameters; verify reads temperature, top_k, top_p, min_p, keys, counters (the output index of
    position 0) and the any_*/all_greedy flags, nothing else. fused=None runs the Triton kernel
    (photon.kernels.spec_verify) on CUDA when triton imports, the torch ops otherwise.
    """
    fused = fused if fused is not None else target_logits.is_cuda and has_triton()
    if not fused:
        return verify_torch(target_logits, draft_ids, num_draft, draft_probs, batch)
    from photon.kernels import spec_verify  # imports triton: only when fused

    tokens, accepted = spec_verify.verify(target_logits, draft_ids, num_draft, draft_probs,
                                          batch, greedy_eps=GREEDY_EPS)
    return VerifyOutput(tokens, accepted)
