"""FP8 W8A8 linear methods: online (`--quantization fp8`) and compressed-tensors checkpoints.

Weights are float8_e4m3fn with one float32 scale per output channel (a per-tensor checkpoint
scale is stored per channel: the same numbers). Activations are quantized per token on the fly,
or with the checkpoint's static per-tensor input_scale. On CUDA the GEMM is torch._scaled_mm
(row-wise scales); on CPU the reference path dequantizes both operands and multiplies in the
activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from photon.quant.base import LinearMethod, ParamLayout, add_param, flat_apply
from photon.quant.numerics import FP8_DTYPE, per_channel_fp8, per_token_fp8, to_fp8

WEIGHT_SCALE = ParamLayout(output_dim=0, input_dim=None, kind="broadcast")
INPUT_SCALE = ParamLayout(output_dim=None, input_dim=None, kind="max")
# torch._scaled_mm needs both GEMM dims of the weight to be multiples of 16.
SCALED_MM_ALIGN = 16


def dequant_linear(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                   w_scale: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """The reference GEMM: dequantize activations [M, K] and weights [N, K], multiply in dtype."""
    x = (xq.float() * x_scale).to(dtype)
    w = (wq.float() * w_scale).to(dtype)
    return F.linear(x, w, bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (activation dtype) times fp8 weight [N, K] with scales [N, 1] -> [M, N]."""
    if input_scale is None:
        xq, xs = _per_token(x)
    else:
        xs = input_scale.reshape(1, 1)
        xq = to_fp8(x, xs)
    if not x.is_cuda:
        return dequant_linear(xq, xs, weight, weight_scale, bias, x.dtype)
    # Row-wise scaled_mm: scale_a [M, 1] and scale_b [1, N], float32; bf16 output.
    out = torch._scaled_mm(xq, weight.t(), scale_a=xs.expand(x.shape[0], 1).contiguous(),
                           scale_b=weight_scale.reshape(1, -1), out_dtype=torch.bfloat16)
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def _per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 activations: one fused kernel on CUDA, the torch reference elsewhere."""
    if not x.is_cuda:
        return per_token_fp8(x)
    from photon.kernels.quant import per_token_fp8_fused

    return per_token_fp8_fused(x.contiguous())


def check_scaled_mm_shape(name: str, input_size: int, output_size: int) -> None:
    if input_size % SCALED_MM_ALIGN or output_size % SCALED_MM_ALIGN:
        raise ValueError(f"{name}: a linear layer of [{output_size}, {input_size}] cannot run the "
                         f"FP8 GEMM on CUDA (both sizes must be multiples of {SCALED_MM_ALIGN})")


class Fp8LinearMethod(LinearMethod):
    """`--quantization fp8`: the checkpoint's floating weights become FP8 with per-channel scales
    at load time; activations dynamic per token."""

    name = "fp8"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype) -> None:
        add_param(layer, "weight", torch.empty(output_size, input_size, dtype=dtype),
                  ParamLayout())
        if layer.weight.is_cuda:
            check_scaled_mm_shape(self.name, input_size, output_size)

    def process_weights(self, layer: nn.Module) -> None:
        q, scale = per_channel_fp8(layer.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        return flat_apply(x, lambda x2: fp8_linear(x2, layer.weight, layer.weight_scale, None,
                                                   bias))


class CompressedFp8Method(LinearMethod):
    """compressed-tensors FP8 W8A8: float8_e4m3fn weights with per-channel or per-tensor
    weight_scale; activations dynamic per token, or static with input_scale."""

    def __init__(self, static_input: bool) -> None:
        self.static_input = static_input
        self.name = f"W8A8-FP8 ({'static' if static_input else 'dynamic'} activations)"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype) -> None:
        add_param(layer, "weight", torch.empty(output_size, input_size, dtype=FP8_DTYPE),
                  ParamLayout(dtype=FP8_DTYPE))
        add_param(layer, "weight_scale", torch.empty(output_size, 1, dtype=torch.float32),
                  WEIGHT_SCALE)
        if self.static_input:
            add_param(layer, "input_scale", torch.zeros((), dtype=torch.float32), INPUT_SCALE)
        if layer.weight.is_cuda:
            check_scaled_mm_shape(self.name, input_size, output_size)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        input_scale = layer.input_scale if self.static_input else None
        return flat_apply(x, lambda x2: fp8_linear(x2, layer.weight, layer.weight_scale,
                                                   input_scale, bias))
