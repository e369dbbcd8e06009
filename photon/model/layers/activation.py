"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from photon.kernels import USE_TRITON

if USE_TRITON:
    from photon.kernels import elementwise


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and USE_TRITON:
            return elementwise.silu_and_mul(x)
        return self.forward_torch(x)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The torch implementation: the CPU path and the kernel's oracle."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
