"""Model-side attention layer: reshapes heads and delegates to the step's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from photon.attention.backend import ForwardContext


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """q [T, H*D] or [T, H, D]; k, v likewise with Hkv heads. Returns [T, H*D]."""
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        scales = None if ctx.kv_scales is None else ctx.kv_scales.layer(self.layer_idx, k, v)
        out = ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.metadata, self.scale,
                                  scales)
        return out.reshape(-1, self.num_heads * self.head_dim)
