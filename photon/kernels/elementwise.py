"""Fused elementwise kernels: RMSNorm (+ residual add), neox rotary, SiLU-and-mul.

Each kernel reproduces the rounding of the torch layer it replaces (norm.py, rotary.py,
activation.py): math in float32, with a cast to the activation dtype wherever the torch code
produces an activation-dtype tensor. Outputs are fresh contiguous tensors; nothing syncs the
host and every shape is static, so all of them can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


# ----------------------------------------------------------------------------- rms norm


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_heads, stride_xt, stride_xh,
                     stride_rt, stride_rh, dim, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = (row // n_heads).to(tl.int64)
    h = (row % n_heads).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_rt + h * stride_rh + cols, mask=mask, other=0.0)
        # residual = x + residual, rounded to the activation dtype (HF's decoder layer).
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row.to(tl.int64) * dim + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)  # HF: cast back before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * dim + cols,
             (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, heads, stride_t, stride_h) for x [T, D] or [T, H, D] with a unit last stride."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() not in (2, 3):
        x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = x.shape
    x = _as_rows(x)
    res_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, res_dtype),
                      device=x.device)
    res_out = None
    if residual is not None:
        residual = _as_rows(residual)
        assert residual.shape == x.shape, (residual.shape, x.shape)
        res_out = torch.empty(x.shape, dtype=res_dtype, device=x.device)
    if x.shape[:-1].numel() > 0:
        _launch_rms_norm(x, residual, weight, out, res_out, eps)
    return out.view(shape), None if res_out is None else res_out.view(shape)


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     out: torch.Tensor, res_out: torch.Tensor | None, eps: float) -> None:
    rows, heads, sxt, sxh = _rows(x)
    srt = srh = 0
    if residual is not None:
        _, _, srt, srh = _rows(residual)
    dim = x.shape[-1]
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out,
        res_out if res_out is not None else out, heads, sxt, sxh, srt, srh, dim, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype) over the last dim, math in float32."""
    out, _ = _rms_norm(x, None, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the add is rounded to the activation dtype."""
    out, res_out = _rms_norm(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


# ----------------------------------------------------------------------------- rotary


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, n_heads, stride_t, stride_h,
                   stride_cache, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (heads < n_heads)[:, None] & (d < HALF)[None, :]
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # The caches hold cat(freqs, freqs): the first half serves both halves of the head.
    # rotary.py casts them to the activation dtype before use; so do we.
    cos = tl.load(cos_ptr + pos * stride_cache + d, mask=d < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cache + d, mask=d < HALF, other=0.0)
    cos = cos.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
    sin = sin.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
    src = x_ptr + t * stride_t + heads.to(tl.int64)[:, None] * stride_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # q * cos + rotate_half(q) * sin, each torch op rounded to the activation dtype.
    o1 = ((x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    dst = out_ptr + (t * n_heads + heads.to(tl.int64)[:, None]) * (2 * HALF) + d[None, :]
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)


def _rotary_one(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor,
                sin_cache: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(heads), max(1, 2048 // block_d))
    grid = (tokens, triton.cdiv(heads, block_h))
    _rotary_kernel[grid](x, out, positions, cos_cache, sin_cache, heads, x.stride(0),
                         x.stride(1), cos_cache.stride(0), HALF=half, BLOCK_H=block_h,
                         BLOCK_D=block_d, num_warps=4)
    return out


def rotary_neox(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place neox rope on q [T, H, D], k [T, Hkv, D] (last dim contiguous) at positions.

    cos_cache / sin_cache: [max_pos, D] contiguous float32, each row cat(freqs, freqs).
    """
    assert q.shape[-1] % 2 == 0 and cos_cache.stride(-1) == 1 and sin_cache.stride(-1) == 1
    return (_rotary_one(positions, q, cos_cache, sin_cache),
            _rotary_one(positions, k, cos_cache, sin_cache))


# ----------------------------------------------------------------------------- silu and mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, stride_x, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + width + cols, mask=mask, other=0.0)
    dt = gate.dtype
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu rounds to the dtype
    tl.store(out_ptr + t * width + cols, (act * up.to(tl.float32)).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    width = shape[-1] // 2
    out = torch.empty((x.shape[0], width), dtype=x.dtype, device=x.device)
    if x.shape[0] > 0 and width > 0:
        block = min(1024, triton.next_power_of_2(width))
        grid = (x.shape[0], triton.cdiv(width, block))
        _silu_and_mul_kernel[grid](x, out, width, x.stride(0), BLOCK=block, num_warps=4)
    return out.view(*shape[:-1], width)
