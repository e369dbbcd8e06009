"""Dequantize-GEMM for weight-only int4 / int8 weights (W4A16, W8A16): out = x @ dequant(W)^T.

W is compressed-tensors' pack-quantized layout: int32 words [N, K / (32 / BITS)], value j of a
word at bits BITS * j, stored offset by 2^(BITS-1); float32 scales [N, K / GROUP]; optional int8
zero points [N, K / GROUP] (unpacked at load). Each program computes a [BLOCK_M, BLOCK_N] tile,
dequantizing a [BLOCK_K, BLOCK_N] slice of W per step in registers; accumulation is float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@triton.jit
def _wna16_gemm(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K,
                stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
                BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x_mask = (rm[:, None] < M) & (kk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=x_mask, other=0.0)
        w_mask = (kk[:, None] < K) & (rn[None, :] < N)
        words = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] // PACK, mask=w_mask,
                        other=0)
        q = (words >> ((kk[:, None] % PACK) * BITS)) & ((1 << BITS) - 1)
        q = q - (1 << (BITS - 1))
        group = kk[:, None] // GROUP
        scale = tl.load(s_ptr + rn[None, :] * stride_sn + group, mask=w_mask, other=0.0)
        if HAS_ZP:
            zero = tl.load(z_ptr + rn[None, :] * stride_zn + group, mask=w_mask, other=0)
            q = q - zero.to(tl.int32)
        w = (q.to(tl.float32) * scale).to(x.dtype)
        acc = tl.dot(x, w, acc)
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def wna16_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               zero: torch.Tensor | None, num_bits: int, group_size: int) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype (x contiguous; the weight tensors as loaded)."""
    m, k = x.shape
    n = packed.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    z = zero if zero is not None else scale  # unread when HAS_ZP is False
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _wna16_gemm[grid](x, packed, scale, z, out, m, n, k,
                      x.stride(0), packed.stride(0), scale.stride(0), z.stride(0), out.stride(0),
                      BITS=num_bits, GROUP=group_size, HAS_ZP=zero is not None,
                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
