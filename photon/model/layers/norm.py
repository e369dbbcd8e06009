"""RMSNorm with optional fused residual add (HF semantics)."""

from __future__ import annotations

import torch
from torch import nn

from photon.kernels import elementwise_kernel
from photon.model.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, use_triton: bool = False) -> None:
        super().__init__()
        self.eps = eps
        # Triton kernels for CUDA tensors; None: the torch ops only.
        self.rms_kernel = elementwise_kernel("rms_norm", use_triton)
        self.add_rms_kernel = elementwise_kernel("fused_add_rms_norm", use_triton)
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Like HF: normalize in float32, cast back to the input dtype, then scale by the weight.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if self.rms_kernel is not None and self.add_rms_kernel is not None and x.is_cuda:
            if residual is None:
                return self.rms_kernel(x, self.weight, self.eps)
            return self.add_rms_kernel(x, residual, self.weight, self.eps)
        return self.forward_torch(x, residual)

    def forward_torch(
        self, x: torch.Tensor, residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch implementation: the CPU path and the kernels' oracle."""
        if residual is None:
            return self._norm(x)
        # The add happens in the activation dtype, as in HF's decoder layer.
        residual = x + residual
        return self._norm(residual), residual
