"""Per-token activation quantization in one kernel (FP8 e4m3 and INT8), for the W8A8 GEMMs, and
the INT8 GEMM's scaling epilogue in one kernel.

Each program quantizes one row (token) of x [M, K]: a first pass over the row finds its absolute
maximum, a second writes q = x / scale saturated to the format's range (FP8: round to nearest
even by the conversion; INT8: rint, half to even) and the row's float32 scale
(amax / format max, at least MIN_SCALE). The torch reference (photon.quant.numerics) takes about
eight kernels for the same result; this takes one, which matters in a decode step with four
quantized linears per layer. Same bits as the reference.

`scale_int32` turns torch._int_mm's int32 accumulators into the linear's output: float32
acc * row scale * column scale, rounded once to the output dtype, then the bias added in that
dtype; the torch expression it replaces makes four passes over the [M, N] result (and a fifth
for the bias) where this makes one.
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


@triton.jit
def _scale_int32_kernel(acc_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, stride_acc, stride_out,
                        stride_xs, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    acc = tl.load(acc_ptr + rows[:, None].to(tl.int64) * stride_acc + cols[None, :], mask=mask,
                  other=0)
    xs = tl.load(xs_ptr + rows * stride_xs, mask=rows < M, other=0.0)  # stride 0: per tensor
    ws = tl.load(ws_ptr + cols, mask=cols < N, other=0.0)
    # (acc * xs) * ws in float32, one rounding to the output dtype: the torch expression's bits
    out = ((acc.to(tl.float32) * xs[:, None]) * ws[None, :]).to(out_ptr.dtype.element_ty)
    if HAS_BIAS:  # out + bias in the output dtype, as torch adds two bf16 tensors
        bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
        out = (out.to(tl.float32) + bias.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], out, mask=mask)


def scale_int32(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """acc [M, N] int32 (rows contiguous), x_scale [M, 1] or [1, 1] and w_scale [N, 1] float32
    -> (acc * x_scale * w_scale^T).to(dtype) (+ bias), one kernel."""
    m, n = acc.shape
    out = torch.empty(m, n, dtype=dtype, device=acc.device)
    if m == 0 or n == 0:
        return out
    xs = x_scale.reshape(-1)  # [M] per token or [1] per tensor: read with stride 0
    block_m, block_n = 16, 256
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _scale_int32_kernel[grid](acc, xs, w_scale.reshape(-1), bias if bias is not None else out,
                              out, m, n, acc.stride(0), out.stride(0),
                              xs.stride(0) if xs.numel() == m else 0, HAS_BIAS=bias is not None,
                              BLOCK_M=block_m, BLOCK_N=block_n)
    return out
