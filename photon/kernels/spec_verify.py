"""Fused verification of speculative drafts (photon.spec.rejection's algorithm and noise).

One program per row walks the K+1 scored positions: per position one pass over the vocabulary
gives the kept-set softmax statistics (max and sum of exp(s - max) over s = logits / temperature
>= the row's min_p/top_k/top_p threshold, from photon.kernels.sampling.filter_thresholds) and the
raw argmax; p(x) of the draft token then is one load. After the accept tests, one more statistics
pass and one draw pass at the first rejected (or the bonus) position emit the token: no [B, K+1, V]
probabilities, no sort, no host sync. The noise is the torch path's, bit for bit (the hash of
photon.kernels.sampling), so the two paths emit the same tokens up to float rounding of the
probabilities (a decision within ~1e-7 of its threshold).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from photon.core.sampling import ACCEPT_SALT, RESIDUAL_SALT
from photon.kernels.sampling import (
    _bits,
    _block,
    _div,
    _gumbel,
    _row_seed,
    _scaled,
    filter_thresholds,
)

if TYPE_CHECKING:
    from photon.worker.sampler import SamplingBatch

_ACCEPT_KEY = tl.constexpr(ACCEPT_SALT << 32)  # photon.spec.rejection.salted_keys
_RESIDUAL_KEY = tl.constexpr(RESIDUAL_SALT << 32)


@triton.jit
def _better(best, idx, score, cols):
    """Lane-wise running argmax: each lane keeps its first maximum (strict >)."""
    take = score > best
    return tl.where(take, score, best), tl.where(take, cols, idx)


@triton.jit
def _first_argmax(best, idx, vocab):
    """torch.argmax's answer from the lanes: the smallest index holding the maximum."""
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, idx, vocab), axis=0)


@triton.jit
def _stats(row_ptr, vocab, temp, thr, BLOCK: tl.constexpr):
    """(m, z, argmax): m = max and z = sum exp(s - m) over the kept s = x / temp >= thr; the
    first argmax of s (for a greedy row temp is 1: the raw logits' argmax, its token)."""
    m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
    z_vec = tl.zeros([BLOCK], dtype=tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s, mask = _scaled(row_ptr, cols, vocab, temp)
        kept = mask & (s >= thr)
        m_new = tl.maximum(m_vec, tl.where(kept, s, float("-inf")))
        alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m_vec - m_new))
        z_vec = z_vec * alpha + tl.where(kept, tl.exp(s - m_new), 0.0)
        m_vec = m_new
        best, best_idx = _better(best, best_idx, s, cols)
    m = tl.max(m_vec, axis=0)
    z = tl.sum(tl.where(m_vec == float("-inf"), 0.0, z_vec * tl.exp(m_vec - m)), axis=0)
    return m, z, _first_argmax(best, best_idx, vocab)


@triton.jit
def _draw(row_ptr, vocab, temp, thr, m, z, seed, rejected, q_row, x_last, HAS_Q: tl.constexpr,
          BLOCK: tl.constexpr):
    """The token at the emitting position: after a rejection, Gumbel-max over log max(0, p - q)
    (over log p if that is all zero); else over the kept s (the sampler's bonus draw)."""
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    idx = tl.zeros([BLOCK], dtype=tl.int32)
    fb_best = tl.full([BLOCK], float("-inf"), tl.float32)
    fb_idx = tl.zeros([BLOCK], dtype=tl.int32)
    r_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s, mask = _scaled(row_ptr, cols, vocab, temp)
        kept = mask & (s >= thr)
        g = _gumbel(_bits(seed, cols))
        p = tl.where(kept, tl.exp(s - m) / z, 0.0)
        if HAS_Q:
            q = tl.load(q_row + cols, mask=mask, other=0.0)
        else:
            q = (cols == x_last).to(tl.float32)
        r = tl.maximum(p - q, 0.0)
        r_sum += r
        bonus = tl.where(kept, s + g, float("-inf"))
        score = tl.where(rejected, tl.log(r) + g, bonus)
        best, idx = _better(best, idx, tl.where(mask, score, float("-inf")), cols)
        fb_best, fb_idx = _better(fb_best, fb_idx, tl.where(mask, tl.log(p) + g, float("-inf")),
                                  cols)
    main = _first_argmax(best, idx, vocab)
    fallback = _first_argmax(fb_best, fb_idx, vocab)
    return tl.where(rejected & (tl.sum(r_sum, axis=0) <= 0.0), fallback, main)


@triton.jit(do_not_specialize_on_alignment=["temp_ptr", "keys_ptr", "counters_ptr", "thr_ptr",
                                            "num_draft_ptr", "accepted_ptr"])
def _verify_kernel(logits_ptr, stride_row, stride_pos, vocab, K, temp_ptr, keys_ptr, counters_ptr,
                   param_stride, thr_ptr, draft_ptr, num_draft_ptr, q_ptr, tokens_ptr, accepted_ptr,
                   greedy_eps, past_drafts, HAS_THRESHOLD: tl.constexpr, HAS_Q: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + row * param_stride)
    greedy = temp < greedy_eps
    temp = tl.where(greedy, 1.0, temp)
    key = tl.load(keys_ptr + row * param_stride).to(tl.int64)
    ctr = tl.load(counters_ptr + row * param_stride).to(tl.int64)
    num_draft = tl.load(num_draft_ptr + row).to(tl.int32)
    zero = tl.full([], 0, tl.int32)
    accepted = zero
    going = zero + 1
    thr = tl.full([], float("-inf"), tl.float32)
    for j in range(0, K):
        row_ptr = logits_ptr + row * stride_row + j * stride_pos
        if HAS_THRESHOLD:
            thr = tl.load(thr_ptr + row * (K + 1) + j)
        m, z, top = _stats(row_ptr, vocab, temp, thr, BLOCK)
        x = tl.load(draft_ptr + row * K + j).to(tl.int32)
        s_x = _div(tl.load(row_ptr + x), temp)
        p_x = tl.where(s_x >= thr, tl.exp(s_x - m) / z, 0.0)
        q_x = 1.0
        if HAS_Q:
            q_x = tl.load(q_ptr + (row * K + j) * vocab + x)
        bits = _bits(_row_seed(key ^ _ACCEPT_KEY, ctr + j), zero)
        u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
        ok = tl.where(greedy, x == top, u * q_x < p_x) & (j < num_draft)
        going = going & ok.to(tl.int32)
        accepted += going
    rejected = accepted < num_draft
    row_ptr = logits_ptr + row * stride_row + accepted * stride_pos
    if HAS_THRESHOLD:
        thr = tl.load(thr_ptr + row * (K + 1) + accepted)
    m, z, top = _stats(row_ptr, vocab, temp, thr, BLOCK)
    last = tl.minimum(accepted, K - 1)
    x_last = tl.load(draft_ptr + row * K + last, mask=K > 0, other=0).to(tl.int32)
    seed = _row_seed(tl.where(rejected, key ^ _RESIDUAL_KEY, key), ctr + accepted)
    drawn = _draw(row_ptr, vocab, temp, thr, m, z, seed, rejected,
                  q_ptr + (row * K + last) * vocab, x_last, HAS_Q, BLOCK)
    emitted = tl.where(greedy, top, drawn).to(tl.int64)
    for j in range(0, K + 1):
        d = tl.load(draft_ptr + row * K + j, mask=j < K, other=0).to(tl.int64)
        tok = tl.where(j < accepted, d,
                       tl.where(j == accepted, emitted, tl.where(j > num_draft, past_drafts, -1)))
        tl.store(tokens_ptr + row * (K + 1) + j, tok)
    tl.store(accepted_ptr + row, accepted)


def _thresholds(flat: torch.Tensor, width: int, batch: SamplingBatch,
                greedy_eps: float) -> torch.Tensor | None:
    """[B*(K+1)] keep thresholds of every scored position, or None when no row filters
    (`width`: how many scored positions share one entry of `batch`)."""
    if batch.all_greedy or not (batch.any_min_p or batch.any_top_k or batch.any_top_p):
        return None

    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(width) if width > 1 else t[:flat.shape[0]]

    return filter_thresholds(flat, rep(batch.temperature), rep(batch.top_k), rep(batch.top_p),
                             rep(batch.min_p), use_top_k=batch.any_top_k,
                             use_top_p=batch.any_top_p, use_min_p=batch.any_min_p,
                             greedy_eps=greedy_eps)


def verify(target_logits: torch.Tensor, draft_ids: torch.Tensor, num_draft: torch.Tensor,
           draft_probs: torch.Tensor | None, batch: SamplingBatch, *, greedy_eps: float,
           per_position: bool = False, past_drafts: int = -1
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, K+1] int64, num_accepted [B] int32): photon.spec.rejection.verify's contract.

    per_position: `batch` holds one entry per scored position (B * (K+1), row b's K+1 in order,
    equal within a row) instead of one per row; row b's parameters are those of entry b * (K+1).
    past_drafts: the token stored at positions past a row's num_draft + 1 (-1 in the contract)."""
    rows, width, vocab = target_logits.shape
    k = width - 1
    logits = target_logits.float().contiguous()
    drafts = draft_ids.long().contiguous()
    tokens = torch.empty((rows, width), dtype=torch.int64, device=logits.device)
    accepted = torch.empty(rows, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return tokens, accepted
    thr = _thresholds(logits.view(rows * width, vocab), 1 if per_position else width, batch,
                      greedy_eps)
    q = draft_probs.float().contiguous() if draft_probs is not None else None
    _verify_kernel[(rows,)](
        logits, logits.stride(0), logits.stride(1), vocab, k, batch.temperature, batch.keys,
        batch.counters, width if per_position else 1, thr if thr is not None else
        batch.temperature, drafts, num_draft, q if q is not None else logits, tokens, accepted,
        greedy_eps, past_drafts, HAS_THRESHOLD=thr is not None, HAS_Q=q is not None,
        BLOCK=min(1024, _block(vocab)), num_warps=8)
    return tokens, accepted
