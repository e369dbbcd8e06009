"""Shared pieces of the MoE decoder families (Qwen3-MoE, Mixtral): the sparse MLP block (router
+ routed experts) and the mapping of HF's per-expert checkpoint tensors onto the stacked expert
weights of FusedMoE. Attention, norms and the dense MLP are the Llama graph's."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from photon.attention.backend import ForwardContext
from photon.config import ConfigError
from photon.distributed.dp_experts import DPExperts
from photon.distributed.group import TPGroup
from photon.model.layers import ReplicatedLinear
from photon.model.layers.moe import FusedMoE
from photon.model.llama import DecoderFlags, LlamaForCausalLM


@dataclass(frozen=True)
class MoESettings:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # top-k weights rescaled to sum to 1


class SparseMoeBlock(nn.Module):
    """x [T, H] -> the router's top-k experts' outputs, weighted and summed."""

    def __init__(self, hidden_size: int, moe: MoESettings, use_triton: bool,
                 tp: TPGroup | None = None, expert_parallel: bool = False,
                 dp_experts: DPExperts | None = None) -> None:
        super().__init__()
        # The router is replicated: every rank routes every token the same way.
        self.gate = ReplicatedLinear(hidden_size, moe.num_experts)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, hidden_size, moe.intermediate_size,
                                moe.renormalize, use_triton, tp=tp,
                                expert_parallel=expert_parallel, dp_experts=dp_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


# HF's per-expert tensors: `...experts.<id>.<proj>.weight`; gate/up -> w13 rows, down -> w2.
_EXPERT_WEIGHT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_SHARD_OF = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w2": "w2",
             "w3": "w3"}


def map_expert_name(hf_name: str) -> tuple[str, tuple[int, str]] | None:
    """(stacked parameter name, (expert id, w1|w2|w3)) for a per-expert tensor, else None."""
    m = _EXPERT_WEIGHT.match(hf_name)
    if m is None:
        return None
    shard = _SHARD_OF[m.group(3)]
    param = "w2_weight" if shard == "w2" else "w13_weight"
    return f"{m.group(1)}.{param}", (int(m.group(2)), shard)


def positive_int(cfg: dict[str, Any], *names: str) -> int:
    """The first of `names` present in config.json, checked to be a positive integer."""
    value = next((cfg[n] for n in names if cfg.get(n) is not None), None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json field {names[0]} must be a positive integer, "
                          f"got {value!r}")
    return value


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-graph decoder whose MLPs are (some or all) sparse MoE blocks.

    Under tensor parallelism attention, embeddings, the LM head and dense MLPs are split as in
    the dense decoders; the experts are split by intermediate dimension, or with
    `expert_parallel` partitioned whole over the ranks (each rank loads only its experts).
    With `dp_experts` the experts are partitioned over the data-parallel cores of that group
    (photon.distributed.dp_experts) and attention runs each core's own batch."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype,
                 device: torch.device | str, use_triton: bool = False,
                 tp: TPGroup | None = None, expert_parallel: bool = False,
                 dp_experts: DPExperts | None = None) -> None:
        # Read by make_mlp while the base class builds the layers.
        self.expert_parallel = expert_parallel
        self.dp_experts = dp_experts
        super().__init__(hf_config, dtype, device, use_triton, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        if self.dp_experts is not None:
            # Every MoE layer exchanges padded batches with the other cores: agree on their
            # size once, before the first layer.
            self.dp_experts.begin_forward(input_ids.shape[0])
        return super().forward(input_ids, positions, ctx)

    @staticmethod
    def moe_settings(cfg: dict[str, Any]) -> MoESettings:
        raise NotImplementedError

    @classmethod
    def is_sparse_layer(cls, cfg: dict[str, Any], layer_idx: int) -> bool:
        return True

    def make_mlp(self, cfg: dict[str, Any], layer_idx: int, flags: DecoderFlags,
                 use_triton: bool, tp: TPGroup | None = None,
                 quant: object = None) -> nn.Module:
        # quant: always None here (photon.quant.config refuses to quantize the MoE families).
        if not self.is_sparse_layer(cfg, layer_idx):
            return super().make_mlp(cfg, layer_idx, flags, use_triton, tp)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (only silu)")
        return SparseMoeBlock(int(cfg["hidden_size"]), self.moe_settings(cfg), use_triton, tp,
                              self.expert_parallel, self.dp_experts)

    def map_weight_name(self, hf_name: str) -> tuple[str, Any]:
        return map_expert_name(hf_name) or super().map_weight_name(hf_name)

    def expected_shards(self, name: str) -> set[Any] | None:
        experts = range(self.moe_settings(self.hf_config).num_experts)
        if name.endswith(".experts.w13_weight"):
            return {(e, w) for e in experts for w in ("w1", "w3")}
        if name.endswith(".experts.w2_weight"):
            return {(e, "w2") for e in experts}
        return super().expected_shards(name)
