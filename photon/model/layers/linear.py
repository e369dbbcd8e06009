"""Linear layers laid out for tensor parallelism.

Each layer takes the rank's `TPGroup` at construction (None: a single rank, no collectives).

Every parameter carries `weight_loader(param, loaded[, shard_id])` that copies a full (unsharded)
checkpoint tensor into this rank's slice of the parameter. Parameters are created with
torch.empty under the caller's default device/dtype; the checkpoint fills them.

A layer built with a quantization `LinearMethod` (photon.quant) lets the method create its
parameters and run its GEMM; `output_slice` / `input_slice` tell the method's loaders where a
checkpoint tensor (or fused shard) lands in this rank's parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from photon.distributed.group import TPGroup
from photon.quant.base import Slice

if TYPE_CHECKING:
    from photon.lora.layers import LoRALinear
    from photon.quant.base import LinearMethod


def tp_or_single(tp: TPGroup | None) -> TPGroup:
    return tp if tp is not None else TPGroup.single()


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a whole tensor; shape mismatches raise ValueError (the caller adds the name)."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(loaded.shape)}, "
            f"parameter expects {tuple(param.shape)}")
    param.data.copy_(loaded)


def copy_into(dest: torch.Tensor, src: torch.Tensor) -> None:
    if dest.shape != src.shape:
        raise ValueError(
            f"shape mismatch: checkpoint slice has {tuple(src.shape)}, "
            f"parameter slice expects {tuple(dest.shape)}")
    dest.copy_(src)


def new_param(*shape: int, loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {d}")
    return n // d


class ReplicatedLinear(nn.Module):
    """Full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = new_param(output_size, input_size, loader=default_weight_loader)
        self.bias = new_param(output_size, loader=default_weight_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class QuantizableLinear(nn.Module):
    """The weight: a plain [out, in] parameter, or the parameters of a quantization method."""

    quant_method: LinearMethod | None = None
    # Set with --enable-lora on the adapted projections: adds the tokens' LoRA deltas to the
    # GEMM's output (photon.lora.layers), whatever the quantization method.
    lora: LoRALinear | None = None

    def create_weight(self, input_size: int, output_size: int,
                      quant: LinearMethod | None) -> None:
        self.quant_method = quant
        if quant is None:
            self.weight = new_param(output_size, input_size, loader=self.weight_loader)
        else:
            quant.create_weights(self, input_size, output_size, torch.get_default_dtype())

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is None:
            out = F.linear(x, self.weight, bias)
        else:
            out = self.quant_method.apply(self, x, bias)
        return out if self.lora is None else self.lora.add(x, out)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: Any) -> None:
        raise NotImplementedError

    def output_slice(self, shard_id: Any = None) -> Slice:
        raise NotImplementedError

    def input_slice(self) -> Slice:
        raise NotImplementedError


class ColumnParallelLinear(QuantizableLinear):
    """Output dim split across ranks; each rank returns its slice (no gather)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TPGroup | None = None, quant: LinearMethod | None = None) -> None:
        super().__init__()
        self.tp = tp_or_single(tp)
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.input_size = input_size
        self.output_size_per_partition = _divide(output_size, self.tp_size, "output_size")
        self.create_weight(input_size, self.output_size_per_partition, quant)
        self.bias = (new_param(self.output_size_per_partition, loader=self.weight_loader)
                     if bias else None)

    def output_slice(self, shard_id: Any = None) -> Slice:
        size = self.output_size_per_partition
        return Slice(0, size, self.tp_rank * size, size * self.tp_size)

    def input_slice(self) -> Slice:
        return Slice.whole(self.input_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: Any = None) -> None:
        s = self.output_slice(shard_id)
        copy_into(param.data.narrow(0, s.offset, s.size), loaded.narrow(0, s.start, s.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one matrix (e.g. gate_up: shard 0 gate, 1 up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: TPGroup | None = None, quant: LinearMethod | None = None) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp, quant)

    def output_slice(self, shard_id: Any = None) -> Slice:
        if shard_id is None:  # the packed tensor itself
            return super().output_slice()
        sizes = [_divide(s, self.tp_size, "output_size") for s in self.output_sizes]
        size = sizes[shard_id]
        return Slice(sum(sizes[:shard_id]), size, self.tp_rank * size, self.output_sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed as [q | k | v] along the output dim (per rank)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPGroup | None = None,
                 quant: LinearMethod | None = None) -> None:
        tp_size = tp_or_single(tp).size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "num_heads")
        # KV heads are replicated when there are fewer of them than ranks.
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        self.total_kv_heads = num_kv_heads
        total = (num_heads + 2 * self.num_kv_heads * tp_size) * head_dim
        super().__init__(hidden_size, total, bias, tp, quant)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def output_slice(self, shard_id: Any = None) -> Slice:
        if shard_id == "q":
            return Slice(0, self.q_size, self.tp_rank * self.q_size, self.q_size * self.tp_size)
        if shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            rank = self.tp_rank // self.kv_replicas
            return Slice(offset, self.kv_size, rank * self.kv_size,
                         self.total_kv_heads * self.head_dim)
        raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class RowParallelLinear(QuantizableLinear):
    """Input dim split across ranks; partial outputs are summed (all-reduce when tp_size > 1)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TPGroup | None = None, quant: LinearMethod | None = None) -> None:
        super().__init__()
        self.tp = tp_or_single(tp)
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.output_size = output_size
        self.input_size_per_partition = _divide(input_size, self.tp_size, "input_size")
        self.create_weight(self.input_size_per_partition, output_size, quant)
        # The bias is not split; only rank 0 adds it so the all-reduce counts it once.
        self.bias = new_param(output_size, loader=default_weight_loader) if bias else None

    def output_slice(self, shard_id: Any = None) -> Slice:
        return Slice.whole(self.output_size)

    def input_slice(self) -> Slice:
        size = self.input_size_per_partition
        return Slice(0, size, self.tp_rank * size, size * self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[1]
        copy_into(param.data, loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            self.tp.all_reduce(out)
        return out
