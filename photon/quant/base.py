"""The linear-method interface: how a quantization scheme creates, loads and runs a linear layer.

A linear layer built with a `LinearMethod` lets the method register its parameters
(`create_weights`), calls `process_weights` once after the checkpoint is loaded, and runs
`apply` in forward. Parameters carry a `ParamLayout` saying which of their dims are output and
input channels, so one loader (`load_sliced`) cuts every checkpoint tensor (a fused q/k/v or
gate/up shard, a tensor-parallel slice, a packed or grouped dim) the way the layer's weight is cut.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from photon.quant.numerics import unpack_int32


@dataclass(frozen=True)
class Slice:
    """Where one checkpoint tensor lands along a channel dim: `size` channels from source channel
    `start` go to parameter channel `offset`; the source has `total` channels along that dim."""

    offset: int
    size: int
    start: int
    total: int

    @classmethod
    def whole(cls, size: int) -> Slice:
        return cls(0, size, 0, size)


@dataclass(frozen=True)
class ParamLayout:
    """How a quantized parameter's dims map to the layer's channels.

    output_dim / input_dim: the dims holding output / input channels (None: not along it);
    input_pack: input channels per element along input_dim (values per packed int32 word, or the
    group size of group scales); kind: "sliced" (cut like the weight), "broadcast" (sliced, and a
    one-element source fills the whole output slice: a per-tensor scale of a fused shard stored
    per channel), "max" (a scalar: the max over the fused shards' values), "shape" (the source is
    the shard's [out, in] shape: checked, not stored); dtype: the checkpoint dtype the scheme
    stores (None: any floating dtype); unpack_output_bits: the source packs output channels into
    int32 words of this many bits (asymmetric zero points)."""

    output_dim: int | None = 0
    input_dim: int | None = 1
    input_pack: int = 1
    kind: str = "sliced"
    dtype: torch.dtype | None = None
    unpack_output_bits: int | None = None


def add_param(layer: nn.Module, name: str, data: torch.Tensor, layout: ParamLayout) -> None:
    """Register `data` as layer.<name>, loaded by load_sliced through the layer's slices."""
    param = nn.Parameter(data, requires_grad=False)

    def loader(p: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        load_sliced(p, loaded, layout, layer.output_slice(shard_id), layer.input_slice())

    param.weight_loader = loader  # type: ignore[attr-defined]
    param.quant_layout = layout  # type: ignore[attr-defined]
    layer.register_parameter(name, param)


def load_sliced(param: nn.Parameter, loaded: torch.Tensor, layout: ParamLayout,
                out: Slice, inp: Slice) -> None:
    """Copy this rank's (and this shard's) part of checkpoint tensor `loaded` into `param`;
    ValueError saying what does not match (the caller adds the tensor's name)."""
    if layout.kind == "shape":
        _check_shape_tensor(loaded, out, inp)
        return
    _check_dtype(loaded, layout)
    if layout.kind == "max":
        if loaded.numel() != 1:
            raise ValueError(f"expected one value (a per-tensor scale), got shape "
                             f"{tuple(loaded.shape)}")
        param.data.copy_(torch.maximum(param.data, loaded.reshape(()).to(param.dtype)))
        return
    if layout.unpack_output_bits is not None:
        loaded = unpack_int32(loaded, layout.unpack_output_bits, out.total, dim=0)
    if layout.kind == "broadcast" and loaded.numel() == 1:
        param.data.narrow(0, out.offset, out.size).copy_(loaded.reshape(()))
        return
    if loaded.dim() == param.dim() - 1 and param.shape[-1] == 1:
        loaded = loaded.unsqueeze(-1)  # a per-channel vector [N] stored as [N, 1]
    dest, src = param.data, loaded
    if dest.dim() != src.dim():
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                         f"{dest.dim()} dims")
    for dim, sl, pack in ((layout.output_dim, out, 1), (layout.input_dim, inp, layout.input_pack)):
        if dim is None:
            continue
        want = math.ceil(sl.total / pack)
        if src.shape[dim] != want:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}: dim {dim} "
                             f"has {src.shape[dim]} entries, expected {want}")
        dest = dest.narrow(dim, sl.offset // pack, math.ceil(sl.size / pack))
        src = src.narrow(dim, sl.start // pack, math.ceil(sl.size / pack))
    if dest.shape != src.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, parameter part "
                         f"expects {tuple(dest.shape)}")
    dest.copy_(src)


def _check_dtype(loaded: torch.Tensor, layout: ParamLayout) -> None:
    if layout.dtype is not None and loaded.dtype != layout.dtype:
        raise ValueError(f"checkpoint tensor is {loaded.dtype}, the scheme stores {layout.dtype}")
    if layout.dtype is None and not loaded.is_floating_point():
        raise ValueError(f"checkpoint tensor is {loaded.dtype}, expected a floating dtype")


def _check_shape_tensor(loaded: torch.Tensor, out: Slice, inp: Slice) -> None:
    got = [int(v) for v in loaded.reshape(-1).tolist()]
    if got != [out.total, inp.total]:
        raise ValueError(f"weight_shape is {got}, the layer's weight is [{out.total}, "
                         f"{inp.total}]")


class LinearMethod(ABC):
    """One quantization scheme's linear layer. Stateless across layers: per-layer state lives in
    the layer's parameters."""

    name: str = ""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype) -> None:
        """Register the layer's parameters for a local [output_size, input_size] weight (this
        rank's part); dtype: the model's activation dtype."""

    def process_weights(self, layer: nn.Module) -> None:
        """Once, after the checkpoint is loaded (or dummy weights are drawn); by default the
        loaded parameters are used as they are."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size] in x's dtype (never syncs with the host)."""


def flat_apply(x: torch.Tensor, fn: object) -> torch.Tensor:
    """Run fn on x as [M, K] (any leading dims folded into M) and restore the leading dims."""
    lead = x.shape[:-1]
    out = fn(x.reshape(-1, x.shape[-1]))  # type: ignore[operator]
    return out.reshape(*lead, out.shape[-1])
