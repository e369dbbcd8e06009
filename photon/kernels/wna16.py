"""GEMM for weight-only int4 / int8 weights (W4A16, W8A16): out = x @ dequant(W)^T (+ bias).

W is compressed-tensors' pack-quantized layout: int32 words [N, K / (32 / BITS)], value j of a
word at bits BITS * j, stored offset by 2^(BITS-1); float32 scales [N, K / GROUP]; optional int8
zero points [N, K / GROUP] (unpacked at load). A weight value is (q - zero) * scale, computed in
float32 and rounded to x's dtype, exactly as the reference path (WNA16Method.dequantized) does.

Two paths, chosen by the number of rows (tokens) M, as vLLM does for its Triton AWQ/GPTQ GEMM:
- M >= DEQUANT_MIN_TOKENS (prefill, decode batches past 32 rows): `_wna16_dequant` writes the
  whole weight once as [N, K] in x's dtype, then cuBLAS multiplies (torch.nn.functional.linear).
- smaller M (decode): `_wna16_gemm` fuses the two: each program computes a [BLOCK_M, BLOCK_N]
  tile, dequantizing a [BLOCK_K, BLOCK_N] slice of W per step in registers (float32 accumulation),
  so only the packed weight is read. When the tiles alone would leave SMs idle, K is split over
  SPLIT programs that write float32 partials; they are summed in a fixed order afterwards (no
  atomics), so every result is bitwise reproducible run to run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# K is split only for M <= this (one BLOCK_M tile of rows): there the grid is N / BLOCK_N programs
# and small N (e.g. 1024) would leave most SMs idle; for more rows the float32 partials' traffic
# would outweigh the gain. It is a BLOCK_M boundary, so splitting adds no other switch point in M.
SPLIT_K_MAX_TOKENS = 32
# From this many rows on, dequantizing the weight once per call and handing the GEMM to cuBLAS is
# faster: past SPLIT_K_MAX_TOKENS the fused kernel's grid is cdiv(M, 64) x N / 128 programs and
# dequantizes the weight once per row tile, and dequantize + cuBLAS beats it on every layer of
# both benchmark shapes (`tools/bench_wna16.py`, docs/benchmarks.md). Below it the call is bound
# by reading the weight, and the fused kernel reads only the packed words (1/4 or 1/2 of bf16's).
DEQUANT_MIN_TOKENS = SPLIT_K_MAX_TOKENS + 1
# Each split keeps at least this many BLOCK_K steps (a split of one step is all overhead).
MIN_K_STEPS_PER_SPLIT = 2
# The dequantize kernel's tile.
DEQUANT_BLOCK_N, DEQUANT_BLOCK_K = 32, 128


@dataclass(frozen=True)
class GemmTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def gemm_tiles(m: int) -> GemmTiles:
    """The fused kernel's tile for M rows: the smallest BLOCK_M that holds them (up to 64), so a
    decode step does not compute masked rows; longer K steps while the row tile is small."""
    if m <= 16:
        return GemmTiles(16, 64, 128, 4)
    if m <= 32:
        return GemmTiles(32, 64, 128, 4)
    return GemmTiles(64, 128, 64, 4)


@triton.jit
def _value_bits(words, j: tl.constexpr, BITS: tl.constexpr):
    """Value j of each word, in the low bits of the float 2^23 (see _dequant_tile)."""
    return ((words >> (j * BITS)) & ((1 << BITS) - 1)) | 0x4B000000


@triton.jit
def _unpack(words, BITS: tl.constexpr, PACK: tl.constexpr):
    """[.., W] words -> [.., W, 2, 2(, 2)] values by constant shifts; value j of word w lands
    at flat index j (the last joined axis is j's lowest bit), so a reshape gives k order."""
    if PACK == 4:
        out = tl.join(tl.join(_value_bits(words, 0, BITS), _value_bits(words, 2, BITS)),
                      tl.join(_value_bits(words, 1, BITS), _value_bits(words, 3, BITS)))
    else:
        even = tl.join(tl.join(_value_bits(words, 0, BITS), _value_bits(words, 4, BITS)),
                       tl.join(_value_bits(words, 2, BITS), _value_bits(words, 6, BITS)))
        odd = tl.join(tl.join(_value_bits(words, 1, BITS), _value_bits(words, 5, BITS)),
                      tl.join(_value_bits(words, 3, BITS), _value_bits(words, 7, BITS)))
        out = tl.join(even, odd)
    return out


@triton.jit
def _dequant_tile(w_ptr, s_ptr, z_ptr, rn, k0, N, K, stride_wn, stride_sn, stride_zn,
                  BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[rn, k0:k0 + BLOCK_K] as float32 [BLOCK_N, BLOCK_K] (k0 < K a multiple of BLOCK_K, which is
    a multiple of PACK). The words are loaded once each, contiguous along K, and unpacked by
    constant shifts (`_unpack`) so that value j of word w lands at k = w * PACK + j."""
    PACK: tl.constexpr = 32 // BITS
    tl.static_assert(PACK == 4 or PACK == 8, "4-bit or 8-bit weights only")
    rw = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    w_mask = (rn[:, None] < N) & (rw[None, :] < K // PACK)
    words = tl.load(w_ptr + rn[:, None] * stride_wn + rw[None, :], mask=w_mask, other=0)
    kk = k0 + tl.arange(0, BLOCK_K)
    # The stored value u (0 <= u < 2^BITS) as float32 without a conversion instruction: the
    # bits 0x4B000000 | u are the float 2^23 + u, and subtracting 2^23 + the offset (and the
    # zero point) leaves u - 2^(BITS-1) - zero exactly (all integers below 2^24).
    f = _unpack(words, BITS, PACK).to(tl.float32, bitcast=True)
    f = tl.reshape(f, [BLOCK_N, BLOCK_K])
    bias = 8388608.0 + (1 << (BITS - 1))
    mask = (rn[:, None] < N) & (kk[None, :] < K)
    if GROUP % BLOCK_K == 0:
        # The tile lies in one group (and K, a multiple of GROUP, has no partial tile): one
        # scale (and zero point) per row.
        n_mask = rn[:, None] < N
        group = k0 // GROUP
        scale = tl.load(s_ptr + rn[:, None] * stride_sn + group, mask=n_mask, other=0.0)
        if HAS_ZP:
            zero = tl.load(z_ptr + rn[:, None] * stride_zn + group, mask=n_mask, other=0)
            bias = bias + zero.to(tl.float32)
    else:
        group = kk[None, :] // GROUP
        scale = tl.load(s_ptr + rn[:, None] * stride_sn + group, mask=mask, other=0.0)
        if HAS_ZP:
            zero = tl.load(z_ptr + rn[:, None] * stride_zn + group, mask=mask, other=0)
            bias = bias + zero.to(tl.float32)
    return (f - bias) * scale


@triton.jit
def _wna16_dequant(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_zn,
                   stride_on, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rk = k0 + tl.arange(0, BLOCK_K)
    w = _dequant_tile(w_ptr, s_ptr, z_ptr, rn, k0, N, K, stride_wn, stride_sn, stride_zn,
                      BITS, GROUP, HAS_ZP, BLOCK_N, BLOCK_K)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _wna16_gemm(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, K_PER_SPLIT,
                stride_xm, stride_wn, stride_sn, stride_zn, stride_os, stride_om,
                BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (i, j, s) computes rows tile i, columns tile j over K's split s (K_PER_SPLIT is a
    multiple of BLOCK_K) into out[s] (stride_os is 0 when K is not split)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_PER_SPLIT
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Ends at K: no tile starts past it (the one-group scale load below is not masked on k).
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        kk = k0 + rk
        x_mask = (rm[:, None] < M) & (kk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=x_mask, other=0.0)
        w = _dequant_tile(w_ptr, s_ptr, z_ptr, rn, k0, N, K, stride_wn, stride_sn, stride_zn,
                          BITS, GROUP, HAS_ZP, BLOCK_N, BLOCK_K)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + tl.program_id(2) * stride_os + rm[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_split_k(m: int, n: int, k: int, tiles: GemmTiles, device: torch.device) -> int:
    """K splits for the fused kernel: doubled while the grid has fewer programs than the device
    has SMs and each split keeps MIN_K_STEPS_PER_SPLIT steps. Depends on M only through
    SPLIT_K_MAX_TOKENS (a BLOCK_M boundary); 1 off CUDA."""
    if device.type != "cuda" or m > SPLIT_K_MAX_TOKENS:
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    programs = triton.cdiv(n, tiles.block_n)  # one row tile: m <= SPLIT_K_MAX_TOKENS
    k_steps = triton.cdiv(k, tiles.block_k)
    split = 1
    while programs * split < sms and k_steps >= 2 * split * MIN_K_STEPS_PER_SPLIT:
        split *= 2
    return split


def wna16_dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     num_bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in dtype (bitwise equal to the reference path's dequantize)."""
    n, k = packed.shape[0], packed.shape[1] * (32 // num_bits)
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    z = zero if zero is not None else scale  # unread when HAS_ZP is False
    grid = (triton.cdiv(n, DEQUANT_BLOCK_N), triton.cdiv(k, DEQUANT_BLOCK_K))
    _wna16_dequant[grid](packed, scale, z, out, n, k, packed.stride(0), scale.stride(0),
                         z.stride(0), out.stride(0), BITS=num_bits, GROUP=group_size,
                         HAS_ZP=zero is not None, BLOCK_N=DEQUANT_BLOCK_N,
                         BLOCK_K=DEQUANT_BLOCK_K)
    return out


def _fused_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                zero: torch.Tensor | None, num_bits: int, group_size: int,
                split_k: int | None) -> torch.Tensor:
    m, k = x.shape
    n = packed.shape[0]
    tiles = gemm_tiles(m)
    split = split_k if split_k is not None else choose_split_k(m, n, k, tiles, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), tiles.block_k) * tiles.block_k
    split = triton.cdiv(k, k_per_split)  # no empty split
    out = torch.empty(split, m, n, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    z = zero if zero is not None else scale  # unread when HAS_ZP is False
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split)
    _wna16_gemm[grid](x, packed, scale, z, out, m, n, k, k_per_split,
                      x.stride(0), packed.stride(0), scale.stride(0), z.stride(0),
                      out.stride(0) if split > 1 else 0, out.stride(1),
                      BITS=num_bits, GROUP=group_size, HAS_ZP=zero is not None,
                      BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                      num_warps=tiles.num_warps)
    if split == 1:
        return out[0]
    # A reduction over the leading dim in a fixed order (no atomics): deterministic.
    return out.sum(dim=0).to(x.dtype)


def wna16_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               zero: torch.Tensor | None, num_bits: int, group_size: int,
               bias: torch.Tensor | None = None, dequant_min_tokens: int = DEQUANT_MIN_TOKENS,
               split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (contiguous) -> [M, N] in x's dtype, with the weight tensors as loaded.
    dequant_min_tokens (the path switch) and split_k (None: chosen per shape and device) are
    parameters so that tests can force each path on tiny shapes."""
    if x.shape[0] >= dequant_min_tokens:
        w = wna16_dequantize(packed, scale, zero, num_bits, group_size, x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    out = _fused_gemm(x, packed, scale, zero, num_bits, group_size, split_k)
    return out if bias is None else out + bias
