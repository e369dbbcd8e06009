"""INT8 W8A8 (compressed-tensors): int8 weights with per-channel scales, int8 activations
quantized per token on the fly (or with a static per-tensor input_scale).

On CUDA the GEMM is torch._int_mm (int32 accumulation), its rows padded to the 17 it needs at
least (a fixed shape: safe in CUDA graphs), and one kernel scales its result into the output
(photon.kernels.quant.scale_int32); on CPU the reference path dequantizes and multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from photon.quant.base import LinearMethod, ParamLayout, add_param, flat_apply
from photon.quant.fp8 import INPUT_SCALE, WEIGHT_SCALE, dequant_linear
from photon.quant.numerics import per_token_int8, to_int

# torch._int_mm: more than 16 rows; the reduction and output dims multiples of 8.
INT_MM_MIN_ROWS = 32
INT_MM_ALIGN = 8


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] times int8 weight [N, K] with scales [N, 1] -> [M, N] in x's dtype."""
    if input_scale is None:
        xq, xs = _per_token(x)
    else:
        xs = input_scale.reshape(1, 1)
        xq = to_int(x, xs, -128, 127)
    if not x.is_cuda or not _int_mm_fits(weight):
        return dequant_linear(xq, xs, weight, weight_scale, bias, x.dtype)
    rows = x.shape[0]
    if rows < INT_MM_MIN_ROWS:
        xq = F.pad(xq, (0, 0, 0, INT_MM_MIN_ROWS - rows))
    acc = torch._int_mm(xq, weight.t())[:rows]
    from photon.kernels.quant import scale_int32

    return scale_int32(acc, xs, weight_scale, bias, x.dtype)


def _per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token INT8 activations: one fused kernel on CUDA, the torch reference elsewhere."""
    if not x.is_cuda:
        return per_token_int8(x)
    from photon.kernels.quant import per_token_int8_fused

    return per_token_int8_fused(x.contiguous())


def _int_mm_fits(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return n % INT_MM_ALIGN == 0 and k % INT_MM_ALIGN == 0


class CompressedInt8Method(LinearMethod):
    def __init__(self, static_input: bool) -> None:
        self.static_input = static_input
        self.name = f"W8A8-INT8 ({'static' if static_input else 'dynamic'} activations)"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype) -> None:
        add_param(layer, "weight", torch.empty(output_size, input_size, dtype=torch.int8),
                  ParamLayout(dtype=torch.int8))
        add_param(layer, "weight_scale", torch.empty(output_size, 1, dtype=torch.float32),
                  WEIGHT_SCALE)
        if self.static_input:
            add_param(layer, "input_scale", torch.zeros((), dtype=torch.float32), INPUT_SCALE)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        input_scale = layer.input_scale if self.static_input else None
        return flat_apply(x, lambda x2: int8_linear(x2, layer.weight, layer.weight_scale,
                                                    input_scale, bias))
