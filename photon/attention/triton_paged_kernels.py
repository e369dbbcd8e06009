"""Triton paged attention: KV write, split-K flash-decoding and a paged varlen prefill kernel.

Cache layout (see backend.py): kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim].
Every kernel gathers K/V per token through the block table (token n of a sequence lives in page
block_tables[seq, n // block_size] at offset n % block_size), so any block size works.

Decode (one query token per sequence, CUDA-graph capturable: no host reads of device tensors):
  * `_decode_split_kernel`, grid (num_seqs, num_kv_heads, num_splits). One program owns every
    query head of one KV group (q tile [GROUP_PAD >= 16, D]), so each K/V tile is read once per
    group, and one contiguous range of `tokens_per_split` context positions. It runs an fp32
    online softmax over its range and writes the partial (max, sum, acc), or, with one split,
    the final output directly.
  * `_decode_reduce_kernel`, grid (num_seqs, num_heads): rescales and sums the partials.
  The split count depends only on Python ints (batch size, KV heads, block-table width), never
  on seq_lens, so one graph per batch size at full table width stays valid for every step.
Prefill / chunked prefill / mixed steps: `_prefill_kernel`, grid
  (num_seqs, cdiv(max_query_len, BLOCK_M), num_heads). Query j of sequence i sits at absolute
  position seq_len - q_len + j and attends causally to the cached positions <= its own.
FP8 cache (FP8 constexpr): the write stores x / scale saturated to +-448; the attention kernels
load the FP8 tiles, convert them to q's dtype (exact; the decode kernel of a 16-bit model converts
them to float16 and uses K as the first dot operand, see DecodeTuning) and apply the program's KV
head's scales to the scores (K) and to the accumulator (V), so no tile is multiplied element by
element.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_e4m3(x):
    """x (|x| <= 448) rounded half to even onto e4m3's grid (3 mantissa bits, subnormal step
    2^-9), in float32. Triton's interpreter converts float32 to float8 without carrying the
    rounding into the exponent (7.9 becomes 4); values already on the grid convert exactly."""
    ax = tl.abs(x)
    step = tl.exp2(tl.floor(tl.log2(tl.maximum(ax, 0.015625))) - 3.0)
    r = ax / step
    f = tl.floor(r)
    odd = f - 2.0 * tl.floor(f * 0.5)
    f = tl.where((r - f > 0.5) | ((r - f == 0.5) & (odd == 1.0)), f + 1.0, f) * step
    return tl.where(x < 0, -f, f)


@triton.jit
def _to_fp8(x, scale, FP8_MAX: tl.constexpr, ROUND_FIRST: tl.constexpr):
    y = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
    if ROUND_FIRST:
        y = _round_e4m3(y)
    return y


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kv, stride_blk, stride_off, stride_ch,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                     FP8: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_FIRST: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dmask = d < HEAD_DIM
    dst = (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_off + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dmask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dmask, other=0.0)
    if FP8:
        k = _to_fp8(k, tl.load(k_scale_ptr + h), FP8_MAX, ROUND_FIRST)
        v = _to_fp8(v, tl.load(v_scale_ptr + h), FP8_MAX, ROUND_FIRST)
    out_ty = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + dst, k.to(out_ty), mask=dmask)
    tl.store(cache_ptr + stride_kv + dst, v.to(out_ty), mask=dmask)


@triton.jit
def _load_page_tile(cache_ptr, bt_row_ptr, n, nmask, d, dmask, kv_head,
                    stride_blk, stride_off, stride_ch, BLOCK_SIZE: tl.constexpr):
    """Offsets [BLOCK_N, D_PAD] of context positions n (gathered through the block table)."""
    blk = tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    row = blk * stride_blk + (n % BLOCK_SIZE) * stride_off + kv_head * stride_ch
    return row[:, None] + d[None, :], nmask[:, None] & dmask[None, :]


@triton.jit
def _decode_split_kernel(q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, out_ptr,
                         part_acc_ptr, part_m_ptr, part_l_ptr, k_scale_ptr, v_scale_ptr,
                         scale, max_ctx, tokens_per_split, num_splits,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                         stride_kv, stride_blk, stride_off, stride_ch,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, NUM_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr,
                         FP8: tl.constexpr, FP8_F16: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # A padded row (seq_len 0 or 1, table of zeros) still attends to one position: finite output.
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + b), 1), max_ctx)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qmask,
                other=0.0)
    q, k_scale, v_scale = _compute_q(q, cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, scale, FP8,
                                     FP8_F16)
    q_t = tl.trans(q)
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, seq_len)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        offs, kvmask = _load_page_tile(cache_ptr, bt_row, n, nmask, d, dmask, kv_head,
                                       stride_blk, stride_off, stride_ch, BLOCK_SIZE)
        k = tl.load(cache_ptr + offs, mask=kvmask, other=0.0).to(q.dtype)
        if FP8_F16:  # K as the dot's first operand: an 8-bit tile is not transposed on loading
            s = tl.trans(tl.dot(k, q_t, input_precision=DOT_PREC)) * k_scale
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * k_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(cache_ptr + stride_kv + offs, mask=kvmask, other=0.0).to(q.dtype)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    acc = acc * v_scale
    if DIRECT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        row = (b * NUM_HEADS + heads) * num_splits + split  # partials are [B, H, S(, D)]
        tl.store(part_m_ptr + row, m_i, mask=gmask)
        tl.store(part_l_ptr + row, l_i, mask=gmask)
        tl.store(part_acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=qmask)


@triton.jit
def _compute_q(q, cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, scale, FP8: tl.constexpr,
               FP8_F16: tl.constexpr = False):
    """(q in the dots' dtype, the scores' factor, the accumulator's factor). Unquantized: q in
    the cache's dtype, factors (softmax scale, 1); FP8: q keeps its dtype (the FP8 tiles are
    converted to it), or with FP8_F16 becomes float16 (e4m3 -> f16 is one conversion
    instruction, e4m3 -> bf16 several; f16 holds every e4m3 value and bf16 q exactly unless it
    is beyond f16's range, where it is clamped), the head's K scale joins the softmax scale and
    its V scale the output. One return with the same types on both paths: the compiler checks
    every return of a function against the others, constexpr branches included."""
    if FP8:
        if FP8_F16:
            q_dot = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        else:
            q_dot = q
        k_factor = scale * tl.load(k_scale_ptr + kv_head).to(tl.float32)
        v_factor = tl.load(v_scale_ptr + kv_head).to(tl.float32)
    else:
        q_dot = q.to(cache_ptr.dtype.element_ty)
        k_factor = scale * 1.0
        v_factor = 1.0
    return q_dot, k_factor, v_factor


@triton.jit
def _decode_reduce_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, num_splits,
                          stride_ot, stride_oh,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                          SPLITS_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b * NUM_HEADS + h) * num_splits
    sp = tl.arange(0, SPLITS_PAD)
    smask = sp < num_splits
    # Split 0 always holds position 0, so m_max is finite; empty splits (m = -inf) weigh 0.
    m = tl.load(part_m_ptr + base + sp, mask=smask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + base + sp, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(smask, tl.exp(m - m_max), 0.0)
    total = tl.sum(w * l_s, 0)
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    for s in range(0, num_splits):
        w_s = tl.exp(tl.load(part_m_ptr + base + s) - m_max)
        acc += w_s * tl.load(part_acc_ptr + (base + s) * D_PAD + d, mask=dmask, other=0.0)
    out = acc / total
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=dmask)


# Prefill runs eagerly with every batch shape: block-table width, context bound and the packed
# per-sequence arrays' offsets vary step to step, and specializing on them would compile a new
# variant mid-run, stalling that step. They feed scalar index math only (the scale pointers,
# rows of one [layers, heads] tensor, are read as scalars).
_PREFILL_VARYING = ["bt_ptr", "seq_lens_ptr", "qsl_ptr", "k_scale_ptr", "v_scale_ptr", "max_ctx",
                    "stride_bt"]


@triton.jit(do_not_specialize=["max_ctx", "stride_bt"],
            do_not_specialize_on_alignment=_PREFILL_VARYING)
def _prefill_kernel(q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, k_scale_ptr,
                    v_scale_ptr, scale, max_ctx,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_kv, stride_blk, stride_off, stride_ch,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PREC: tl.constexpr, FP8: tl.constexpr):
    b = tl.program_id(0)
    m_blk = tl.program_id(1)
    h = tl.program_id(2)
    kv_head = h // GROUP
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_ctx)
    ctx_start = seq_len - q_len  # absolute position of this sequence's first query token
    j = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    jmask = j < q_len
    q_pos = ctx_start + j
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    qmask = jmask[:, None] & dmask[None, :]
    q_offs = (q_start + j)[:, None] * stride_qt + h * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=qmask, other=0.0)
    q, k_scale, v_scale = _compute_q(q, cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, scale, FP8)
    # Keys up to the tile's last query position; an empty tile (past q_len) loops zero times.
    last = tl.minimum(m_blk * BLOCK_M + BLOCK_M, q_len)
    hi = tl.where(m_blk * BLOCK_M < q_len, tl.minimum(ctx_start + last, seq_len), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for start in range(0, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        offs, kvmask = _load_page_tile(cache_ptr, bt_row, n, nmask, d, dmask, kv_head,
                                       stride_blk, stride_off, stride_ch, BLOCK_SIZE)
        k = tl.load(cache_ptr + offs, mask=kvmask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * k_scale
        s = tl.where(nmask[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        # Rows past q_len may see no key at all: keep their max finite so no NaN is formed.
        m_new = tl.maximum(tl.maximum(m_i, tl.max(s, 1)), -1e30)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(cache_ptr + stride_kv + offs, mask=kvmask, other=0.0).to(q.dtype)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    out = acc * v_scale / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = (q_start + j)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=qmask)
