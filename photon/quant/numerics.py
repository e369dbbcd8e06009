"""Quantize / dequantize arithmetic shared by the linear methods and `photon quantize`.

Conventions (compressed-tensors'): a quantized value q stands for (q - zero_point) * scale; scales
are float32; symmetric schemes have no zero point. Nothing here reads a device tensor on the host
(every function is safe inside a CUDA graph).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
INT8_MAX = 127.0
# Smallest scale: an all-zero row or group quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1e-12


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    # amax times the float32 reciprocal, not a division: torch divides by a Python scalar that
    # way on CUDA and exactly on CPU, so this is the one formula every device and kernel shares.
    return (amax.float() * (1.0 / FP8_MAX)).clamp_min(MIN_SCALE)


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale saturated to e4m3's range, as float8_e4m3fn (scale broadcasts against x)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def to_int(x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int,
           zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """round(x / scale) (+ zero_point) clamped to [qmin, qmax], as int8 (round half to even)."""
    q = torch.round(x.float() / scale)
    if zero_point is not None:
        q = q + zero_point.float()
    return q.clamp(qmin, qmax).to(torch.int8)


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scales [M, 1]): one scale per row (token)."""
    scale = fp8_scale(x.abs().amax(dim=-1, keepdim=True))
    return to_fp8(x, scale), scale


def per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M, 1]), symmetric."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() * (1.0 / INT8_MAX)).clamp_min(MIN_SCALE)
    return to_int(x, scale, -127, 127), scale


def per_channel_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [N, K] -> (fp8 [N, K], float32 scales [N, 1]): one scale per output channel."""
    return per_token_fp8(w)


def int_range(num_bits: int) -> tuple[int, int]:
    return -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1


def group_scales(w: torch.Tensor, num_bits: int, group_size: int, symmetric: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RTN scales (and zero points when asymmetric) of weight [N, K] over groups of group_size
    input channels: ([N, K / group_size] float32, int8 or None)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    qmin, qmax = int_range(num_bits)
    if symmetric:
        # Symmetric: the largest magnitude maps to qmax (compressed-tensors' observer).
        return (g.abs().amax(dim=-1) / ((qmax - qmin) / 2)).clamp_min(MIN_SCALE), None
    lo = g.amin(dim=-1).clamp_max(0.0)
    hi = g.amax(dim=-1).clamp_min(0.0)
    scale = ((hi - lo) / (qmax - qmin)).clamp_min(MIN_SCALE)
    zero = torch.round(qmin - lo / scale).clamp(qmin, qmax).to(torch.int8)
    return scale, zero


def quantize_groups(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    num_bits: int) -> torch.Tensor:
    """Weight [N, K] -> int8 [N, K] with the group scales [N, K / G] (and zero points)."""
    group = w.shape[1] // scale.shape[1]
    expand = (lambda t: t.repeat_interleave(group, dim=1))  # noqa: E731
    qmin, qmax = int_range(num_bits)
    return to_int(w, expand(scale), qmin, qmax, None if zero is None else expand(zero))


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """int8 [N, K] with group scales [N, K / G] (and zero points) -> weight [N, K] in dtype."""
    group = q.shape[1] // scale.shape[1]
    w = q.float()
    if zero is not None:
        w = w - zero.float().repeat_interleave(group, dim=1)
    return (w * scale.repeat_interleave(group, dim=1)).to(dtype)


def pack_int32(q: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    """int8 values (in num_bits' signed range) -> int32 words holding 32 / num_bits of them along
    dim, value j at bits num_bits * j, stored offset to unsigned (compressed-tensors' layout)."""
    factor = 32 // num_bits
    u = (q.to(torch.int64) + (1 << (num_bits - 1))).movedim(dim, -1)
    pad = -u.shape[-1] % factor
    u = torch.nn.functional.pad(u, (0, pad)).reshape(*u.shape[:-1], -1, factor)
    shifts = torch.arange(factor, dtype=torch.int64, device=q.device) * num_bits
    words = (u << shifts).sum(dim=-1)
    # Reinterpret the unsigned 32-bit words as int32.
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, size: int, dim: int = 1) -> torch.Tensor:
    """pack_int32's inverse: the first `size` values along dim, as int8."""
    factor = 32 // num_bits
    p = packed.to(torch.int64).movedim(dim, -1)
    shifts = torch.arange(factor, dtype=torch.int64, device=packed.device) * num_bits
    u = (p.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    u = u.reshape(*p.shape[:-1], -1)[..., :size]
    return (u - (1 << (num_bits - 1))).to(torch.int8).movedim(-1, dim).contiguous()
