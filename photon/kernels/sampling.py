"""Fused sampling: per-row keep thresholds (min_p / top_k / top_p) and Gumbel-max, no sort.

`filter_thresholds` gives each row a scaled-logit threshold t such that the kept set is
exactly {v : logits[v] / temperature >= t}; `gumbel_argmax` then draws
argmax_v(logits[v] / temperature + g(key, counter, v)) over the kept set with the same
counter-based noise bits as `photon.worker.sampler.noise_bits` (the hash is reimplemented
here in uint32 arithmetic; tests check the bits are identical). One program per row, looping
over the vocabulary in chunks: no [R, V] intermediate, no host sync, static shapes.

Filter semantics (those of `photon.worker.sampler`, s = logits / temperature):
  * min_p: drop s_v < max(s) + log(min_p);
  * top_k: drop s_v < the k-th largest s (ties at the k-th value are kept), applied to the
    min_p survivors, i.e. threshold max(t_min_p, kth(s));
  * top_p: over the survivors S of the above, with p_v = softmax over S, keep v while the
    mass of the tokens of S strictly above s_v is < top_p; the top token is always kept.
The k-th value and the top_p cut-off are found exactly by a 17-ary search over the 32-bit
ordered-integer images of the float32 values (8 passes over the row, 16 pivots each; the
cut-off is always a value of the row, so `>=` keeps exactly the intended set). Counts are
exact integers; top_p masses are float32 sums of exp(s - max), where the torch path uses a
float32 softmax + cumsum: the two can differ only for a token whose above-mass is within
rounding (~1e-6) of top_p. Cost per row: 1 pass (max) + 8 (top_k) + 9 (top_p) + 1 (draw).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon.core import sampling as rng
from photon.kernels.bitmask import allowed
from photon.structured.bitmask import TokenMask

# The noise hash's constants (photon.core.sampling: the torch sampler reads the same ones).
_MUL_A = tl.constexpr(rng.MUL_A)
_MUL_B = tl.constexpr(rng.MUL_B)
_ROW_SALT = tl.constexpr(rng.ROW_SALT)
_CTR_SALT = tl.constexpr(rng.CTR_SALT)
_VOCAB_SALT = tl.constexpr(rng.VOCAB_SALT)
_NEG_INF_KEY = tl.constexpr(-0x7F800000)  # _ordered(-inf)

_SEARCH_STEPS = tl.constexpr(8)  # 17**8 > 2**32 > the number of ordered keys in [-inf, inf]
_NPIV = 16  # pivots per pass of the searches


def _block(vocab: int) -> int:
    return min(4096, triton.next_power_of_2(max(vocab, 16)))


# One program per row: with a batch smaller than the GPU's SM count the draw's chunk loop is
# latency-bound, and 32 warps a program keep more loads in flight.
DRAW_WARPS = 32


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8


# ----------------------------------------------------------------------------- jit helpers


@triton.jit
def _mix32(x):
    """The bijective 32-bit hash of sampler._mix32, on uint32 (multiplication wraps mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * _MUL_A
    x = x ^ (x >> 15)
    x = x * _MUL_B
    return x ^ (x >> 15)


@triton.jit
def _row_seed(key, counter):
    """sampler._row_seeds for one row: key, counter int64 scalars -> uint32 seed."""
    s = _mix32((key >> 32).to(tl.uint32) ^ _ROW_SALT)
    s = _mix32(s ^ key.to(tl.uint32))
    s = _mix32(s ^ (counter >> 32).to(tl.uint32) ^ _CTR_SALT)
    return _mix32(s ^ counter.to(tl.uint32))


@triton.jit
def _bits(seed, cols):
    """noise_bits for one row's token ids `cols` (int32) -> uint32."""
    return _mix32(seed ^ _mix32(cols.to(tl.uint32) ^ _VOCAB_SALT))


@triton.jit
def _gumbel(bits):
    """sampler.gumbel_noise: u = (top 23 bits + 0.5) * 2**-23 in (0, 1); -log(-log(u))."""
    u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return -tl.log(-tl.log(u))


@triton.jit
def _ordered(x):
    """float32 -> int32 key with the same order (and -0.0 == +0.0); NaN is not supported."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, -(b & 0x7FFFFFFF), b)


@triton.jit
def _unordered(key):
    """Inverse of `_ordered` (int32 key -> float32)."""
    mag = tl.where(key < 0, -key, key).to(tl.float32, bitcast=True)
    return tl.where(key < 0, -mag, mag)


@triton.jit
def _div(x, temp):
    """x / temp correctly rounded (torch's division); plain `/` may be approximate on GPU."""
    return tl.math.div_rn(x, tl.zeros_like(x) + temp)  # div_rn does not broadcast


@triton.jit
def _scaled(row_ptr, cols, vocab, temp):
    """(s, in-range mask) for a chunk: s = logits / temp, IEEE-rounded like torch's division."""
    mask = cols < vocab
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf"))
    return _div(x, temp), mask


@triton.jit
def _row_max(row_ptr, vocab, temp, BLOCK: tl.constexpr):
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        s, _ = _scaled(row_ptr, start + tl.arange(0, BLOCK), vocab, temp)
        acc = tl.maximum(acc, s)
    return tl.max(acc, axis=0)


@triton.jit
def _counts_at_least(row_ptr, vocab, temp, piv, BLOCK: tl.constexpr):
    """[NPIV] int32: #{v : ordered(s_v) >= piv[j]} for each pivot key."""
    acc = tl.zeros(piv.shape, dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        s, mask = _scaled(row_ptr, start + tl.arange(0, BLOCK), vocab, temp)
        hit = (_ordered(s)[:, None] >= piv[None, :]) & mask[:, None]
        acc += tl.sum(hit.to(tl.int32), axis=0)
    return acc


@triton.jit
def _masses_above(row_ptr, vocab, temp, m, floor_key, piv, BLOCK: tl.constexpr):
    """[NPIV] float32: sum of exp(s_v - m) over v with floor_key <= ordered(s_v) > piv[j]."""
    acc = tl.zeros(piv.shape, dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        s, mask = _scaled(row_ptr, start + tl.arange(0, BLOCK), vocab, temp)
        key = _ordered(s)
        e = tl.where(mask & (key >= floor_key), tl.exp(s - m), 0.0)
        acc += tl.sum(tl.where(key[:, None] > piv[None, :], e[:, None], 0.0), axis=0)
    return acc


@triton.jit
def _kth_largest(row_ptr, vocab, temp, m, k, BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """The k-th largest s (1 <= k <= vocab): the largest key u with #{key >= u} >= k.

    (NPIV+1)-ary search over [ordered(-inf), ordered(max)]; invariant: lo satisfies the
    predicate and the answer lies in [lo, hi]. Each pass shrinks hi - lo + 1 to at most
    ceil(previous / (NPIV + 1)), so _SEARCH_STEPS passes of 17-ary search cover 2**32 keys.
    """
    hi = _ordered(m).to(tl.int64)
    lo = hi * 0 + _NEG_INF_KEY
    j = (tl.arange(0, NPIV) + 1).to(tl.int64)
    for _ in range(_SEARCH_STEPS):
        step = (hi - lo + 1 + NPIV) // (NPIV + 1)
        piv = lo + j * step
        ok = (_counts_at_least(row_ptr, vocab, temp, piv, BLOCK) >= k) & (piv <= hi)
        new_lo = lo + tl.max(tl.where(ok, j, 0), axis=0) * step
        hi = tl.minimum(hi, new_lo + step - 1)
        lo = new_lo
    return _unordered(lo.to(tl.int32))


@triton.jit
def _top_p_cutoff(row_ptr, vocab, temp, m, floor, p, BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """Smallest s among {s >= floor} whose strictly-above mass (renormalised over that set)
    is < p; p <= 0 gives max(s) (the top token is always kept).

    Mirror image of `_kth_largest`: invariant hi satisfies the predicate (or is the max) and
    the answer lies in [lo, hi]; pivots step down from hi.
    """
    floor_key = _ordered(floor)
    j = (tl.arange(0, NPIV) + 1).to(tl.int64)
    everything = j * 0 + floor_key - 1
    target = p * tl.max(_masses_above(row_ptr, vocab, temp, m, floor_key, everything, BLOCK),
                        axis=0)
    lo = floor_key.to(tl.int64)
    hi = _ordered(m).to(tl.int64)
    for _ in range(_SEARCH_STEPS):
        step = (hi - lo + 1 + NPIV) // (NPIV + 1)
        piv = hi - j * step
        mass = _masses_above(row_ptr, vocab, temp, m, floor_key, piv, BLOCK)
        ok = (mass < target) & (piv >= lo)
        new_hi = hi - tl.max(tl.where(ok, j, 0), axis=0) * step
        lo = tl.maximum(lo, new_hi - step + 1)
        hi = new_hi
    return _unordered(hi.to(tl.int32))


# ----------------------------------------------------------------------------- kernels


# Per-row scalars come from the step's packed staging buffers at offsets that move with the batch
# size; Triton would compile a variant per pointer alignment (~0.3-0.5 s each, mid-run), and
# alignment buys nothing for one scalar load per row.
@triton.jit(do_not_specialize_on_alignment=["temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr",
                                            "out_ptr"])
def _threshold_kernel(logits_ptr, stride, vocab, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                      out_ptr, greedy_eps, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
                      USE_MIN_P: tl.constexpr, BLOCK: tl.constexpr, NPIV: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    temp = tl.load(temp_ptr + row)
    sampled = temp >= greedy_eps  # greedy rows ignore the threshold: skip the searches
    temp = tl.where(sampled, temp, 1.0)
    m = _row_max(row_ptr, vocab, temp, BLOCK)
    thr = tl.full([], float("-inf"), tl.float32)
    if USE_MIN_P:
        thr = m + tl.log(tl.load(min_p_ptr + row))  # min_p = 0 -> -inf: keeps everything
    if USE_TOP_K:
        k = tl.load(top_k_ptr + row)
        if sampled & (k > 0) & (k < vocab):
            thr = tl.maximum(thr, _kth_largest(row_ptr, vocab, temp, m, k, BLOCK, NPIV))
    if USE_TOP_P:
        p = tl.load(top_p_ptr + row)
        if sampled & (p < 1.0):
            thr = tl.maximum(thr, _top_p_cutoff(row_ptr, vocab, temp, m, thr, p, BLOCK, NPIV))
    tl.store(out_ptr + row, thr)


@triton.jit(do_not_specialize_on_alignment=["temp_ptr", "keys_ptr", "counters_ptr", "thr_ptr",
                                            "out_ptr", "bits_ptr", "tail_ptr"])
def _gumbel_argmax_kernel(logits_ptr, stride, vocab, temp_ptr, keys_ptr, counters_ptr, thr_ptr,
                          out_ptr, greedy_eps, bits_ptr, tail_ptr, words, covered,
                          HAS_THRESHOLD: tl.constexpr, HAS_MASK: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    temp = tl.load(temp_ptr + row)
    greedy = temp < greedy_eps
    temp = tl.where(greedy, 1.0, temp)
    seed = _row_seed(tl.load(keys_ptr + row).to(tl.int64), tl.load(counters_ptr + row).to(tl.int64))
    thr = tl.full([], float("-inf"), tl.float32)
    if HAS_THRESHOLD:
        thr = tl.load(thr_ptr + row)
    tail = tl.full([], 0, tl.int32)
    if HAS_MASK:
        tail = tl.load(tail_ptr + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        # The logits load does not wait for the mask words (one program per row: a dependent
        # load would add its latency to every chunk); a forbidden token scores -inf below.
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf"))
        if HAS_MASK:
            mask = mask & allowed(bits_ptr + row.to(tl.int64) * words, tail, cols, covered)
        s = _div(x, temp)
        score = tl.where(s >= thr, s + _gumbel(_bits(seed, cols)), float("-inf"))
        score = tl.where(greedy, x, score)
        score = tl.where(mask, score, float("-inf"))
        better = score > best  # strict: each lane keeps its first maximum
        best_idx = tl.where(better, cols, best_idx)
        best = tl.where(better, score, best)
    top = tl.max(best, axis=0)
    # torch.argmax returns the first maximal index; an all -inf row gives 0, as torch does.
    first = tl.min(tl.where(best == top, best_idx, vocab), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


@triton.jit(do_not_specialize_on_alignment=["keys_ptr", "counters_ptr"])
def _noise_bits_kernel(keys_ptr, counters_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = _row_seed(tl.load(keys_ptr + row).to(tl.int64), tl.load(counters_ptr + row).to(tl.int64))
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        bits = _bits(seed, cols).to(tl.int64)  # zero-extended
        tl.store(out_ptr + row.to(tl.int64) * vocab + cols, bits, mask=cols < vocab)


# ----------------------------------------------------------------------------- wrappers


def _rows_f32(logits: torch.Tensor) -> torch.Tensor:
    assert logits.dim() == 2 and logits.dtype == torch.float32
    return logits if logits.stride(1) == 1 else logits.contiguous()


def filter_thresholds(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, min_p: torch.Tensor, *, use_top_k: bool,
                      use_top_p: bool, use_min_p: bool, greedy_eps: float) -> torch.Tensor:
    """[R] float32 thresholds on logits / temperature (see the module docstring).

    Greedy rows (temperature < greedy_eps) get an unspecified value; use_* are host flags
    (False skips that filter for every row, whatever the tensor holds).
    """
    logits = _rows_f32(logits)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out
    # Each search pass compares a [BLOCK, NPIV] tile: a smaller chunk than the other kernels.
    block = min(1024, _block(vocab))
    _threshold_kernel[(rows,)](
        logits, logits.stride(0), vocab, temperature, top_k, top_p, min_p, out, greedy_eps,
        USE_TOP_K=use_top_k, USE_TOP_P=use_top_p, USE_MIN_P=use_min_p, BLOCK=block,
        NPIV=_NPIV, num_warps=8)
    return out


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                  counters: torch.Tensor, threshold: torch.Tensor | None, *,
                  greedy_eps: float, mask: TokenMask | None = None) -> torch.Tensor:
    """[R] int64: argmax(logits) for greedy rows, else the Gumbel-max draw
    argmax_v(s_v + gumbel(key, counter, v)) over {v : s_v >= threshold}, s = logits / temp;
    with `mask` (grammar masks), over the tokens it allows only: the same tokens as applying
    the mask to the logits first, without that extra pass (the threshold, if any, must have
    been computed on masked logits)."""
    logits = _rows_f32(logits)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    block = _block(vocab)
    bits, tail = (mask.bits, mask.tail) if mask is not None else (temperature, temperature)
    words = mask.bits.shape[1] if mask is not None else 0
    _gumbel_argmax_kernel[(rows,)](
        logits, logits.stride(0), vocab, temperature, keys, counters,
        threshold if threshold is not None else temperature, out, greedy_eps,
        bits, tail, words, min(vocab, 32 * words),
        HAS_THRESHOLD=threshold is not None, HAS_MASK=mask is not None, BLOCK=block,
        num_warps=DRAW_WARPS)
    return out


def noise_bits(keys: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] int64: the kernels' noise bits (for tests; equals sampler.noise_bits)."""
    out = torch.empty((keys.shape[0], vocab_size), dtype=torch.int64, device=keys.device)
    if keys.shape[0] > 0:
        _noise_bits_kernel[(keys.shape[0],)](keys, counters, out, vocab_size,
                                             BLOCK=_block(vocab_size))
    return out
