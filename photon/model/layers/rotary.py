"""Rotary position embedding (neox / HF-Llama `rotate_half` layout) with llama3 scaling.

Rope settings live in two places depending on the transformers version that wrote config.json:
  * transformers >= 5: `rope_parameters = {"rope_type": ..., "rope_theta": ..., <scaling keys>}`;
  * older: top-level `rope_theta` plus an optional `rope_scaling = {"rope_type"|"type": ...}`.
`rope_settings()` reads either into (theta, scaling-or-None).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from photon.kernels import elementwise_kernel

DEFAULT_ROPE_THETA = 10000.0


def rope_settings(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None for plain rope) from an HF config dict."""
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")
    return theta, dict(params, rope_type="llama3")


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths / factor, short kept, smooth in between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rope to q [T, H, D] and k [T, Hkv, D] at `positions` [T]."""

    def __init__(self, head_dim: int, max_position_embeddings: int, theta: float,
                 scaling: dict[str, Any] | None = None, use_triton: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.kernel = elementwise_kernel("rotary_neox", use_triton)  # None: torch ops only
        inv_freq = _inv_freq(head_dim, theta)
        if scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        # float32 cache of cat(freqs, freqs), exactly as HF builds it; cast to q's dtype at use.
        pos = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernel is not None and q.is_cuda:
            return self.kernel(positions, q, k, self.cos_cache, self.sin_cache)
        return self.forward_torch(positions, q, k)

    def forward_torch(self, positions: torch.Tensor, q: torch.Tensor,
                      k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch implementation: the CPU path and the kernel's oracle."""
        cos = self.cos_cache[positions].to(q.dtype)[:, None, :]
        sin = self.sin_cache[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def get_rope(head_dim: int, hf_config: dict[str, Any], use_triton: bool = False) -> RotaryEmbedding:
    theta, scaling = rope_settings(hf_config)
    max_pos = int(hf_config.get("max_position_embeddings") or 2048)
    return RotaryEmbedding(head_dim, max_pos, theta, scaling, use_triton)
