"""Per-token activation quantization in one kernel (FP8 e4m3 and INT8), for the W8A8 GEMMs.

Each program quantizes one row (token) of x [M, K]: a first pass over the row finds its absolute
maximum, a second writes q = x / scale saturated to the format's range (FP8: round to nearest
even by the conversion; INT8: rint, half to even) and the row's float32 scale
(amax / format max, at least MIN_SCALE). The torch reference (photon.quant.numerics) takes about
eight kernels for the same result; this takes one, which matters in a decode step with four
quantized linears per layer. Same bits as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon.quant.numerics import FP8_DTYPE, FP8_MAX, INT8_MAX, MIN_SCALE

BLOCK_K = 1024


@triton.jit
def _row_amax(x_row, K, BLOCK_K: tl.constexpr):
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.max(amax, axis=0)


@triton.jit
def _per_token_quant(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, QMAX: tl.constexpr,
                     MIN_SCALE: tl.constexpr, IS_INT: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    # amax times 1 / QMAX in float32 and an IEEE division of x (Triton's `/` may be approximate
    # on CUDA): the reference's bits (photon.quant.numerics)
    scale = tl.maximum(_row_amax(x_row, K, BLOCK_K) * (1.0 / QMAX), MIN_SCALE)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.math.div_rn(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32), scale)
        if IS_INT:  # round half to even, as torch.round (libdevice's rint is CUDA-only)
            r = tl.floor(x + 0.5)
            x = tl.where(((r - x) == 0.5) & ((r % 2) != 0), r - 1.0, r)
        x = tl.clamp(x, -QMAX, QMAX)
        tl.store(q_ptr + row.to(tl.int64) * stride_q + k, x.to(q_ptr.dtype.element_ty),
                 mask=k < K)


def _quantize(x: torch.Tensor, dtype: torch.dtype, qmax: float, is_int: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _per_token_quant[(m,)](x, q, scale, k, x.stride(0), q.stride(0), QMAX=qmax,
                               MIN_SCALE=MIN_SCALE, IS_INT=is_int,
                               BLOCK_K=min(BLOCK_K, triton.next_power_of_2(k)))
    return q, scale


def per_token_fp8_fused(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (float8_e4m3fn [M, K], float32 scales [M, 1])."""
    return _quantize(x, FP8_DTYPE, FP8_MAX, False)


def per_token_int8_fused(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (int8 [M, K], float32 scales [M, 1]), symmetric."""
    return _quantize(x, torch.int8, INT8_MAX, True)
