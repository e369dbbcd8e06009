"""Device-side sampler: penalties, bans, greedy, temperature/min_p/top_k/top_p, Gumbel-max.

Invariant: nothing in this module synchronises the host with the device. No `.item()`,
`.tolist()`, `.cpu()`, `nonzero()`, boolean-mask indexing or Python branching on tensor
values; every decision that depends on the batch comes in as a plain Python flag on
`SamplingBatch`. Every tensor shape is a function of (R, V, L, M, max_logprobs) only.

Random sampling uses counter-based noise: the Gumbel noise for (row, token) is a pure
function of (key, counter, token id), so a seeded request draws the same tokens whatever
the batch composition, row order or pipelining, without a torch.Generator per request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from photon.core.inputs import SamplingFlags, StepInputs
from photon.core.sampling import CTR_SALT, M32, MUL_A, MUL_B, ROW_SALT, VOCAB_SALT
from photon.kernels import has_triton
from photon.structured.bitmask import TokenMask, apply_token_bitmask

GREEDY_EPS = 1e-5  # rows with temperature below this are greedy (matches SamplingParams.greedy)


@dataclass
class SamplingBatch:
    """One row per sequence sampled this step; all tensors live on the logits' device."""

    temperature: Tensor  # [R] float32; < GREEDY_EPS means greedy
    top_k: Tensor  # [R] int32; 0 = off
    top_p: Tensor  # [R] float32; 1.0 = off
    min_p: Tensor  # [R] float32; 0.0 = off
    keys: Tensor  # [R] int64 per-request random key (photon.core.sampling.derive_key)
    counters: Tensor  # [R] int64 output index of the token being sampled
    presence_penalty: Tensor  # [R] float32
    frequency_penalty: Tensor  # [R] float32
    repetition_penalty: Tensor  # [R] float32
    ban_rows: Tensor  # [M] int64 \ (row, token) pairs forced to -inf
    ban_tokens: Tensor  # [M] int64 /
    # token_pool[pool_rows[r], :seq_lens[r]] are row r's known tokens; those at positions
    # >= prompt_lens[r] are output tokens.
    token_pool: Tensor | None  # [P, L] int32; None when no row has penalties
    pool_rows: Tensor  # [R] int64
    prompt_lens: Tensor  # [R] int64
    seq_lens: Tensor  # [R] int64
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalties: bool
    max_logprobs: int  # -1: no row wants logprobs
    token_bitmask: TokenMask | None = None  # grammar masks; None: no row has a grammar
    any_logit_bias: bool = False  # some row has logit_bias entries (else the next are not read)
    bias_rows: Tensor | None = None  # [B] int64 \
    bias_tokens: Tensor | None = None  # [B] int64  | logits[row, token] += value
    bias_values: Tensor | None = None  # [B] float32 /
    # [M] int64: ban i holds only while counters[ban_rows[i]] < ban_until[i] (min_tokens against
    # the device's output index); None: every ban holds.
    ban_until: Tensor | None = None


def step_batch(dev: StepInputs[Tensor], flags: SamplingFlags, token_pool: Tensor,
               mask: TokenMask | None) -> SamplingBatch:
    """The batch of a staged step's sampling rows (device views `dev`, the host's `flags`)."""
    return SamplingBatch(
        temperature=dev.temperature, top_k=dev.top_k.to(torch.int32), top_p=dev.top_p,
        min_p=dev.min_p, keys=dev.keys, counters=dev.counters,
        presence_penalty=dev.presence_penalty, frequency_penalty=dev.frequency_penalty,
        repetition_penalty=dev.repetition_penalty, ban_rows=dev.ban_rows,
        ban_tokens=dev.ban_tokens, ban_until=dev.ban_until, bias_rows=dev.bias_rows,
        bias_tokens=dev.bias_tokens, bias_values=dev.bias_values,
        token_pool=token_pool if flags.any_penalties else None, pool_rows=dev.pool_rows,
        prompt_lens=dev.prompt_lens, seq_lens=dev.sample_seq_lens,
        all_greedy=flags.all_greedy, any_top_k=flags.any_top_k, any_top_p=flags.any_top_p,
        any_min_p=flags.any_min_p, any_penalties=flags.any_penalties,
        any_logit_bias=flags.any_logit_bias, max_logprobs=flags.max_logprobs,
        token_bitmask=mask)


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [R] int64
    logprobs: Tensor | None  # [R] float32, raw-distribution logprob of the sampled token
    ranks: Tensor | None  # [R] int64, its 1-based rank: 1 + #tokens with a larger logprob
    topk_ids: Tensor | None  # [R, max_logprobs] int64
    topk_logprobs: Tensor | None  # [R, max_logprobs] float32


# ----------------------------------------------------------------------------- noise


def _mix32(x: Tensor) -> Tensor:
    """Bijective 32-bit integer hash on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * MUL_A) & M32
    x = x ^ (x >> 15)
    x = (x * MUL_B) & M32
    return x ^ (x >> 15)


def _mix32_(x: Tensor) -> Tensor:
    """In-place `_mix32` for the large [R, V] tensor (saves allocations)."""
    x.bitwise_xor_(x >> 16).mul_(MUL_A).bitwise_and_(M32)
    x.bitwise_xor_(x >> 15).mul_(MUL_B).bitwise_and_(M32)
    return x.bitwise_xor_(x >> 15)


def _row_seeds(keys: Tensor, counters: Tensor) -> Tensor:
    """[R] 32-bit seeds from the full 64 bits of key and counter (negative values included)."""
    keys, counters = keys.long(), counters.long()
    # `& M32` on two's-complement int64 extracts the words exactly, even for negatives.
    s = _mix32(((keys >> 32) & M32) ^ ROW_SALT)
    s = _mix32(s ^ (keys & M32))
    s = _mix32(s ^ ((counters >> 32) & M32) ^ CTR_SALT)
    return _mix32(s ^ (counters & M32))


def noise_bits(keys: Tensor, counters: Tensor, vocab_size: int) -> Tensor:
    """[R, V] int64 in [0, 2**32): a deterministic hash of (keys[r], counters[r], v)."""
    seeds = _row_seeds(keys, counters)
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    vocab = _mix32(vocab ^ VOCAB_SALT)
    return _mix32_(seeds[:, None] ^ vocab[None, :])


def uniform_from_bits(bits: Tensor) -> Tensor:
    """float32 u strictly in (0, 1) from hash bits in [0, 2**32)."""
    # Top 23 bits + 0.5, scaled by 2**-23: k + 0.5 < 2**23 needs 24 significant bits, so u is
    # exact in float32 and strictly in (0, 1). (With 24 bits, 2**24 - 0.5 rounds to 2**24: u = 1
    # gave +inf noise for one token in 2**24, i.e. ~1% of steps on a 151k vocabulary, and NaN
    # (picked by argmax) on a grammar-masked -inf logit.)
    return (bits >> 9).to(torch.float32).add_(0.5).mul_(2.0**-23)


def gumbel_noise(keys: Tensor, counters: Tensor, vocab_size: int) -> Tensor:
    """[R, V] float32 standard Gumbel noise, -log(-log(u)), u a hash of (key, counter, v)."""
    u = uniform_from_bits(noise_bits(keys, counters, vocab_size))
    return u.log_().neg_().log_().neg_()


# ----------------------------------------------------------------------------- processing


def _token_counts(batch: SamplingBatch, vocab_size: int) -> tuple[Tensor, Tensor]:
    """([R, V] output-token counts, [R, V] bool seen-anywhere) from the pool history."""
    assert batch.token_pool is not None, "any_penalties requires token_pool"
    hist = batch.token_pool.index_select(0, batch.pool_rows).long()  # [R, L]
    pos = torch.arange(hist.shape[1], device=hist.device)[None, :]
    valid = pos < batch.seq_lens[:, None]
    is_out = valid & (pos >= batch.prompt_lens[:, None])
    # Slots past seq_len may hold garbage ids: point them at token 0 with weight 0.
    tok = torch.where(valid, hist, torch.zeros_like(hist))
    shape = (hist.shape[0], vocab_size)
    out_counts = torch.zeros(shape, dtype=torch.float32, device=hist.device)
    out_counts.scatter_add_(1, tok, is_out.float())
    all_counts = torch.zeros(shape, dtype=torch.float32, device=hist.device)
    all_counts.scatter_add_(1, tok, valid.float())
    return out_counts, all_counts > 0


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition (prompt+output), frequency and presence (output only) penalties, out of place."""
    out_counts, seen = _token_counts(batch, logits.shape[1])
    rep = batch.repetition_penalty[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - batch.frequency_penalty[:, None] * out_counts
    return logits - batch.presence_penalty[:, None] * (out_counts > 0).float()


def apply_logit_bias(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """logits[bias_rows[i], bias_tokens[i]] += bias_values[i] in place (a scatter: no sync)."""
    flat = batch.bias_rows * logits.shape[1] + batch.bias_tokens
    logits.view(-1).index_add_(0, flat, batch.bias_values)
    return logits


def apply_bans(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Set logits[ban_rows[i], ban_tokens[i]] = -inf in place, for the bans that hold (see
    `ban_until`): a gather and a scatter, no sync."""
    flat = batch.ban_rows * logits.shape[1] + batch.ban_tokens
    view = logits.view(-1)
    if batch.ban_until is None:
        view.scatter_(0, flat, float("-inf"))
        return logits
    # Pairs repeat only with the same row and bound, hence the same value: the scatter is exact.
    holds = batch.counters[batch.ban_rows] < batch.ban_until
    view.scatter_(0, flat, torch.where(holds, float("-inf"), view[flat]))
    return logits


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability < min_p * max probability (min_p = 0 keeps all).

    Evaluated in logit space, as the fused CUDA path does: p_v < min_p * p_max
    <=> logit_v < max logit + log(min_p).
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p[:, None].log()
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Top-k then nucleus filtering via one descending sort; the top token is always kept.

    Ties are kept: each filter keeps every token whose logit equals the smallest one it keeps
    (top_k: the k-th largest value; top_p: a token is kept while the mass of the tokens with a
    strictly larger logit is < top_p). The kept set is thus {v : logit_v >= cutoff}, which the
    fused CUDA path (photon.kernels.sampling) computes without a sort.
    """
    vocab = logits.shape[1]
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    cutoff = torch.full_like(sorted_logits[:, :1], float("-inf"))
    if top_k is not None:
        k = top_k.long()
        k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
        cutoff = sorted_logits.gather(1, (k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < cutoff, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above this rank
        # Keep the smallest prefix reaching top_p: a rank is kept while the mass above it
        # is still < top_p. top_p >= 1 keeps everything (guards cumsum rounding past 1.0).
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        keep = (before < top_p[:, None]) | (top_p[:, None] >= 1.0) | (ranks == 0)
        # The kept ranks are a prefix: its last value is the cut-off.
        last = sorted_logits.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
        cutoff = torch.maximum(cutoff, last)
    return logits.masked_fill(logits < cutoff, float("-inf"))


def scale_and_filter(logits: Tensor, temperature: Tensor, min_p: Tensor | None,
                     top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """logits / temperature (greedy rows: / 1), then min_p, top_k, top_p (None: off for every
    row): the scores a random row's token is drawn from, filtered tokens at -inf. Out of place."""
    greedy = temperature < GREEDY_EPS
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    logits = logits / temp[:, None]
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    if top_k is not None or top_p is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits


def _sample_random(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Temperature, min_p, top_k, top_p, then Gumbel-max. Returns [R] int64."""
    logits = scale_and_filter(logits, batch.temperature, batch.min_p if batch.any_min_p else None,
                              batch.top_k if batch.any_top_k else None,
                              batch.top_p if batch.any_top_p else None)
    noise = gumbel_noise(batch.keys, batch.counters, logits.shape[1])
    return (logits + noise).argmax(dim=-1)


def token_logprobs(raw: Tensor, token_ids: Tensor, k: int
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logprob [N], 1-based rank [N], top-k ids [N, k], top-k logprobs [N, k]) of `token_ids`
    in the log-softmaxed rows `raw` [N, V], on the device."""
    sampled = raw.gather(1, token_ids[:, None])
    ranks = (raw > sampled).sum(dim=-1) + 1
    top_lp, top_ids = raw.topk(k, dim=-1) if k > 0 else (raw[:, :0], raw[:, :0].long())
    return sampled.squeeze(1), ranks, top_ids, top_lp


def _needs_threshold(batch: SamplingBatch) -> bool:
    return batch.any_min_p or batch.any_top_k or batch.any_top_p


def _sample_fused(logits: Tensor, batch: SamplingBatch, mask: TokenMask | None = None) -> Tensor:
    """Triton path of greedy/temperature/min_p/top_k/top_p + Gumbel-max: same tokens, no
    sort and no [R, V] noise (photon.kernels.sampling). `mask`: grammar masks applied inside
    the draw (only without a threshold: the threshold searches read the logits themselves)."""
    from photon.kernels import sampling as fused_sampling  # imports triton: only when fused

    threshold = None
    if _needs_threshold(batch):
        assert mask is None, "apply the grammar mask to the logits before the threshold search"
        threshold = fused_sampling.filter_thresholds(
            logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p,
            use_top_k=batch.any_top_k, use_top_p=batch.any_top_p, use_min_p=batch.any_min_p,
            greedy_eps=GREEDY_EPS)
    return fused_sampling.gumbel_argmax(logits, batch.temperature, batch.keys, batch.counters,
                                        threshold, greedy_eps=GREEDY_EPS, mask=mask)


def _fused_apply_bitmask() -> Callable[[Tensor, TokenMask], Tensor]:
    from photon.kernels.bitmask import apply_token_bitmask_  # imports triton: only when fused

    return apply_token_bitmask_


def _draw(logits: Tensor, batch: SamplingBatch, fused: bool, owned: bool) -> Tensor:
    """The grammar mask, then greedy or random sampling. `owned`: logits may be modified."""
    mask = batch.token_bitmask
    if mask is not None and fused and not _needs_threshold(batch):
        return _sample_fused(logits, batch, mask)  # the draw reads the mask (greedy rows too)
    if mask is not None:
        apply = _fused_apply_bitmask() if fused else apply_token_bitmask
        logits = apply(logits if owned else logits.clone(), mask)
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    if fused:
        return _sample_fused(logits, batch)
    greedy = batch.temperature < GREEDY_EPS
    return torch.where(greedy, logits.argmax(dim=-1), _sample_random(logits, batch))


class Sampler:
    """Stateless: `Sampler()(logits [R, V], batch) -> SamplerOutput`, all on-device.

    fused=None picks the Triton kernels for CUDA logits (when triton imports) and the torch
    ops otherwise; True/False forces a path (True on CPU needs TRITON_INTERPRET=1).
    """

    def __init__(self, fused: bool | None = None) -> None:
        self.fused = fused

    def __call__(self, logits: Tensor, batch: SamplingBatch,
                 overwrite: bool = False) -> SamplerOutput:
        """overwrite=True: `logits` may be modified in place (the model runner's are a fresh
        tensor every step), which saves a copy of [R, V] before the mask, bans or penalties."""
        raw, logits, owned = self.process(logits, batch, overwrite)
        token_ids = self.draw(logits, batch, owned)
        if raw is None:
            return SamplerOutput(token_ids, None, None, None, None)
        return SamplerOutput(token_ids, *token_logprobs(raw, token_ids, batch.max_logprobs))

    def process(self, logits: Tensor, batch: SamplingBatch, overwrite: bool = False
                ) -> tuple[Tensor | None, Tensor, bool]:
        """(raw log-softmax when logprobs are wanted, the logits after bias, penalties and bans,
        whether the caller owns them): everything before the grammar mask and the draw."""
        owned = overwrite or logits.dtype != torch.float32  # .float() copies only then
        logits = logits.float()
        raw = torch.log_softmax(logits, dim=-1) if batch.max_logprobs >= 0 else None
        if batch.any_logit_bias:
            logits, owned = apply_logit_bias(logits if owned else logits.clone(), batch), True
        if batch.any_penalties:
            logits, owned = apply_penalties(logits, batch), True
        if batch.ban_rows.numel() > 0:  # a shape, not a value: no sync
            logits, owned = apply_bans(logits if owned else logits.clone(), batch), True
        return raw, logits, owned

    def apply_mask(self, logits: Tensor, mask: TokenMask) -> Tensor:
        """Grammar masks on `logits` (rows aligned), in place."""
        fused = self.fused if self.fused is not None else logits.is_cuda and has_triton()
        return (_fused_apply_bitmask() if fused else apply_token_bitmask)(logits, mask)

    def draw(self, logits: Tensor, batch: SamplingBatch, owned: bool) -> Tensor:
        """The grammar mask, then the draw, on processed logits (`owned`: may be modified)."""
        fused = self.fused if self.fused is not None else logits.is_cuda and has_triton()
        return _draw(logits, batch, fused, owned)
