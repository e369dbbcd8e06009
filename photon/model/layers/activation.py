"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from photon.kernels import elementwise_kernel


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def __init__(self, use_triton: bool = False) -> None:
        super().__init__()
        self.kernel = elementwise_kernel("silu_and_mul", use_triton)  # None: torch ops only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.is_cuda:
            return self.kernel(x)
        return self.forward_torch(x)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The torch implementation: the CPU path and the kernel's oracle."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
