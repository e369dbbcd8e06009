"""Weight-only W4A16 / W8A16 (compressed-tensors pack-quantized, group scales).

Checkpoint tensors per linear: weight_packed int32 [N, K / (32 / bits)], weight_scale [N, K / G],
weight_shape [2], and weight_zero_point (int32, packed along the output dim) when asymmetric.
On CUDA with Triton the GEMM is photon.kernels.wna16 (a fused dequantize-GEMM for few tokens, a
Triton dequantize then cuBLAS for many); otherwise the reference path dequantizes the whole
weight and multiplies in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from photon.quant.base import LinearMethod, ParamLayout, add_param, flat_apply
from photon.quant.numerics import dequantize_groups, unpack_int32

SHAPE = ParamLayout(output_dim=None, input_dim=None, kind="shape", dtype=None)


class WNA16Method(LinearMethod):
    def __init__(self, num_bits: int, group_size: int, symmetric: bool,
                 use_triton: bool = False) -> None:
        self.num_bits, self.group_size, self.symmetric = num_bits, group_size, symmetric
        self.pack = 32 // num_bits
        self.use_triton = use_triton
        self.name = f"W{num_bits}A16 (group_size {group_size}, " \
                    f"{'symmetric' if symmetric else 'asymmetric'})"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype) -> None:
        g = self.group_size
        if input_size % g or g % self.pack:
            raise ValueError(f"{self.name}: a linear layer's input size {input_size} (this "
                             f"rank's part) must be a multiple of the group size {g}, and the "
                             f"group size a multiple of {self.pack}")
        add_param(layer, "weight_packed",
                  torch.empty(output_size, input_size // self.pack, dtype=torch.int32),
                  ParamLayout(input_pack=self.pack, dtype=torch.int32))
        add_param(layer, "weight_scale",
                  torch.empty(output_size, input_size // g, dtype=torch.float32),
                  ParamLayout(input_pack=g))
        add_param(layer, "weight_shape", torch.zeros(2, dtype=torch.int64), SHAPE)
        if not self.symmetric:
            add_param(layer, "weight_zero_point",
                      torch.empty(output_size, input_size // g, dtype=torch.int8),
                      ParamLayout(input_pack=g, dtype=torch.int32,
                                  unpack_output_bits=self.num_bits))

    def dequantized(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight [N, K] in dtype (the reference path)."""
        packed = layer.weight_packed
        q = unpack_int32(packed, self.num_bits, packed.shape[1] * self.pack)
        return dequantize_groups(q, layer.weight_scale, self.zero_point(layer), dtype)

    def zero_point(self, layer: nn.Module) -> torch.Tensor | None:
        return None if self.symmetric else layer.weight_zero_point

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        if not (x.is_cuda and self.use_triton):
            return F.linear(x, self.dequantized(layer, x.dtype), bias)
        return flat_apply(x, lambda x2: self._kernel(layer, x2, bias))

    def _kernel(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
        from photon.kernels.wna16 import wna16_gemm

        return wna16_gemm(x.contiguous(), layer.weight_packed, layer.weight_scale,
                          self.zero_point(layer), self.num_bits, self.group_size, bias)
