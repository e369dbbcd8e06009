"""LoRA in the linear layers: stacked slot weights and the batched delta.

Each adapted linear holds A [S, P * R, in] and B [S, out, P * R] for its S slots (slot 0: the
base model, all zeros), its P parts (the fused qkv_proj has q, k and v; gate_up_proj gate and up)
and the engine's rank R (--max-lora-rank): part p's A fills rows [p * R, p * R + r) and its B the
same columns of the part's output rows, so one shrink and one expand serve a fused layer (B is
block diagonal; lower ranks pad with zeros; the scaling is folded into B). The layer adds
`delta(x)` to its GEMM's output, whatever the quantization method computed it: row-parallel
layers add it before their all-reduce (A holds the rank's input slice: the partial deltas sum).

Per-token slot indices live in `LoRABatch.token_slots`, a device buffer at a fixed address that
the runner fills before each forward: CUDA graphs read it like their other inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from photon.lora.adapter import LoRAAdapter

# Packed linear name -> (target, shard id) parts, in the packed weight's order.
PARTS: dict[str, tuple[tuple[str, Any], ...]] = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "o_proj": (("o_proj", None),),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    "down_proj": (("down_proj", None),),
}
TORCH_CHUNK = 256  # tokens per gather in the torch path: bounds its [T, out, R] gathers


class LoRABatch:
    """The step's per-token slots, shared by every adapted layer."""

    def __init__(self, max_tokens: int, num_slots: int, device: torch.device,
                 use_triton: bool) -> None:
        self.token_slots = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.num_slots = num_slots
        self.use_triton = use_triton
        self.active = False  # the forward adds deltas (off: a step without adapters)
        self.meta: Any = None  # the Triton path's slot grouping for this forward

    def prepare(self, num_tokens: int) -> None:
        """Group the forward's tokens by slot (Triton path), from the filled buffer."""
        if self.use_triton:
            from photon.kernels.lora import lora_meta

            self.meta = lora_meta(self.token_slots[:num_tokens], self.num_slots)


@dataclass(frozen=True)
class _Part:
    target: str
    out_offset: int  # rows of B (and of the layer's output)
    out_size: int
    out_start: int  # rows of the adapter's B this rank takes
    in_start: int  # columns of the adapter's A this rank takes
    in_size: int


class LoRALinear:
    """One adapted linear's slot weights and its delta."""

    def __init__(self, layer: nn.Module, name: str, batch: LoRABatch, rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.batch, self.rank = batch, rank
        inp = layer.input_slice()
        self.parts = []
        for target, shard in PARTS[name]:
            out = layer.output_slice(shard)
            self.parts.append(_Part(target, out.offset, out.size, out.start, inp.start, inp.size))
        width = rank * len(self.parts)
        out_size = sum(p.out_size for p in self.parts)
        s = batch.num_slots
        self.a = torch.zeros(s, width, inp.size, dtype=dtype, device=device)
        self.b = torch.zeros(s, out_size, width, dtype=dtype, device=device)

    def load(self, slot: int, adapter: LoRAAdapter | None, layer_idx: int) -> None:
        """Copy the adapter's weights of this layer into `slot` (enqueued on the current
        stream; None: clear it)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if adapter is None:
            return
        for p, part in enumerate(self.parts):
            pair = adapter.weights.get((layer_idx, part.target))
            if pair is None:
                continue
            a, b = pair
            r, col = a.shape[0], p * self.rank
            self.a[slot, col:col + r].copy_(a[:, part.in_start:part.in_start + part.in_size],
                                            non_blocking=True)
            self.b[slot, part.out_offset:part.out_offset + part.out_size, col:col + r].copy_(
                b[part.out_start:part.out_start + part.out_size], non_blocking=True)

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + the tokens' deltas (in place where the path allows)."""
        if not self.batch.active:
            return out
        if x.stride(-1) != 1:
            x = x.contiguous()
        if self.batch.use_triton:
            from photon.kernels.lora import lora_expand, lora_shrink

            meta = self.batch.meta
            lora_expand(lora_shrink(x, self.a, meta), self.b, meta, out)
            return out
        return out + lora_delta_torch(x, self.a, self.b, self.batch.token_slots[:x.shape[0]])


def lora_delta_torch(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
                     ) -> torch.Tensor:
    """The reference path: gather each token's slot weights, two batched matmuls."""
    parts = []
    for i in range(0, x.shape[0], TORCH_CHUNK):
        s = slots[i:i + TORCH_CHUNK]
        h = torch.bmm(a[s], x[i:i + TORCH_CHUNK].unsqueeze(-1))  # [t, R, 1]
        parts.append(torch.bmm(b[s], h).squeeze(-1))
    return torch.cat(parts).to(x.dtype)


class LoRAModel:
    """Every adapted linear of a model, by (layer, packed name)."""

    def __init__(self, model: nn.Module, batch: LoRABatch, rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.batch = batch
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        for name, module in model.named_modules():
            pieces = name.split(".")
            if pieces[-1] not in PARTS or "layers" not in pieces or \
                    not hasattr(module, "output_slice"):
                continue
            layer_idx = int(pieces[pieces.index("layers") + 1])
            lora = LoRALinear(module, pieces[-1], batch, rank, device, dtype)
            module.lora = lora
            self.layers[(layer_idx, pieces[-1])] = lora

    @property
    def targets(self) -> set[tuple[int, str]]:
        """(layer, target) pairs an adapter may hold weights for."""
        return {(i, part.target) for (i, _), lin in self.layers.items() for part in lin.parts}

    def load(self, slot: int, adapter: LoRAAdapter | None) -> None:
        for (layer_idx, _), lin in self.layers.items():
            lin.load(slot, adapter, layer_idx)
