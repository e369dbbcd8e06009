"""Mixture-of-experts layer: top-k routing and the experts' SiLU-gated MLPs.

Expert weights are stacked: `w13_weight [E_local, 2*I_local, H]` (gate rows then up rows, like
MergedColumnParallelLinear) and `w2_weight [E_local, H, I_local]` (vLLM's names). Experts are
addressed by their global id; this layer holds the contiguous range [first, last) of them. Routed
slots whose expert lies outside the range contribute zero, so with experts partitioned across
ranks a sum over ranks gives the full output.

Under tensor parallelism every rank sees every token (attention replicates the hidden states), so
no dispatch is needed: each rank computes its part of every token's output and one all-reduce
sums the parts. The part is, with expert parallelism, the contribution of the rank's experts
(rank r of N holds experts [r*E/N, (r+1)*E/N), I_local = I); without it, every expert's slice
of the intermediate dimension (I_local = I/N, vLLM's default), like a row-parallel MLP.

With the experts spread over data-parallel engine cores instead (`dp_experts`:
photon.distributed.dp_experts), each core holds its own tokens: the layer gathers every core's
tokens, applies its experts to them and reduce-scatters the outputs back.

On CUDA with use_triton the fused Triton kernels (photon.kernels.fused_moe) run; otherwise the
torch path, which loops over the experts that received tokens (it reads the routed expert ids on
the host, so it is for CPU and as the kernels' oracle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from photon.distributed.dp_experts import DPExperts
from photon.distributed.group import TPGroup
from photon.model.layers.linear import copy_into, new_param, tp_or_single

# Checkpoint shard names of one expert's projections: w1 = gate, w3 = up, w2 = down (Mixtral's
# names; Qwen3-MoE's gate_proj/up_proj/down_proj are mapped onto them).
EXPERT_SHARDS = ("w1", "w2", "w3")


@dataclass(frozen=True)
class ExpertRange:
    """Global expert ids [first, last) held by this layer, out of num_experts."""

    num_experts: int
    first: int
    last: int

    @classmethod
    def whole(cls, num_experts: int) -> ExpertRange:
        return cls(num_experts, 0, num_experts)

    @classmethod
    def of_rank(cls, num_experts: int, rank: int, size: int) -> ExpertRange:
        """Rank `rank` of `size`'s contiguous share (sizes differ by at most one)."""
        return cls(num_experts, rank * num_experts // size, (rank + 1) * num_experts // size)

    @property
    def num_local(self) -> int:
        return self.last - self.first


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], global expert ids int64 [T, k]): softmax over all experts in
    float32, the top k, renormalized to sum to 1 when `renormalize` (which equals a softmax over
    the top-k logits: Mixtral; Qwen3-MoE's `norm_topk_prob`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    experts: ExpertRange) -> torch.Tensor:
    """The torch MoE: x [T, H] -> sum over routed local experts of weight * expert(x), [T, H]."""
    out = torch.zeros_like(x)
    local = (topk_ids >= experts.first) & (topk_ids < experts.last)
    for e in torch.unique(topk_ids[local]).tolist():
        tok, slot = torch.where(topk_ids == e)
        gate, up = F.linear(x[tok], w13[e - experts.first]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e - experts.first])
        out.index_add_(0, tok, (y.float() * topk_weights[tok, slot, None]).to(x.dtype))
    return out


class FusedMoE(nn.Module):
    """Routed experts: forward(x [T, H], router_logits [T, E]) -> [T, H].

    tp: the tensor-parallel group (None: one rank); expert_parallel: partition the experts over
    its ranks instead of each expert's intermediate dimension. `experts` (one rank only) picks a
    range explicitly. dp_experts: the experts are partitioned over the data-parallel cores of
    this group instead (tp must be one rank)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, use_triton: bool = False,
                 experts: ExpertRange | None = None, tp: TPGroup | None = None,
                 expert_parallel: bool = False, dp_experts: DPExperts | None = None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts="
                             f"{num_experts}]")
        self.tp = tp_or_single(tp)
        self.expert_parallel = expert_parallel and self.tp.size > 1
        if self.expert_parallel:
            experts = ExpertRange.of_rank(num_experts, self.tp.rank, self.tp.size)
        self.dp_experts = dp_experts
        if dp_experts is not None:
            if self.tp.size > 1:
                raise ValueError("experts over data-parallel cores need one rank per core")
            experts = ExpertRange.of_rank(num_experts, dp_experts.rank, dp_experts.size)
        self.experts = experts or ExpertRange.whole(num_experts)
        self.top_k, self.renormalize = top_k, renormalize
        # this rank's slice of each expert's intermediate dimension: [i_first, i_first + I_local)
        self.shards = 1 if self.expert_parallel else self.tp.size
        if intermediate_size % self.shards:
            raise ValueError(f"moe intermediate size {intermediate_size} is not divisible by "
                             f"tensor-parallel size {self.shards}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size // self.shards
        self.i_first = 0 if self.expert_parallel else self.tp.rank * self.intermediate_size
        n, i = self.experts.num_local, self.intermediate_size
        self.w13_weight = new_param(n, 2 * i, hidden_size, loader=self.weight_loader)
        self.w2_weight = new_param(n, hidden_size, i, loader=self.weight_loader)
        self.kernel = _fused_moe_kernel(use_triton)  # None: the torch path only

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, str]) -> None:
        """Copy one expert's checkpoint projection; shard_id = (global expert id, w1|w2|w3).
        Experts outside this layer's range are skipped (another rank holds them)."""
        expert, which = shard_id
        if not 0 <= expert < self.experts.num_experts:
            raise ValueError(f"expert id {expert} is out of range: the model has "
                             f"{self.experts.num_experts} experts")
        if which not in EXPERT_SHARDS:
            raise ValueError(f"expert shard must be one of {EXPERT_SHARDS}, got {which!r}")
        if not self.experts.first <= expert < self.experts.last:
            return
        dest = param.data[expert - self.experts.first]
        i, full = self.intermediate_size, self.intermediate_size * self.shards
        want = (self.hidden_size, full) if which == "w2" else (full, self.hidden_size)
        if tuple(loaded.shape) != want:
            raise ValueError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, expert "
                             f"projection {which} expects {want}")
        if which == "w2":  # [H, I]: this rank's input columns
            loaded = loaded.narrow(1, self.i_first, i)
        else:  # [I, H]: this rank's rows, into the gate or the up half
            dest = dest.narrow(0, 0 if which == "w1" else i, i)
            loaded = loaded.narrow(0, self.i_first, i)
        copy_into(dest, loaded)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.dp_experts is not None:
            num_tokens = x.shape[0]
            x, weights, ids = self.dp_experts.dispatch(x, weights, ids)
            return self.dp_experts.combine(self._apply(x, weights, ids), num_tokens)
        # Each rank holds a part of every token's output (its experts, or its intermediate
        # slice of every expert): the sum over the ranks is the whole.
        return self.tp.all_reduce(self._apply(x, weights, ids))

    def _apply(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This layer's experts' part of every token's output."""
        if self.kernel is not None and x.is_cuda:
            return self.kernel(x, self.w13_weight, self.w2_weight, weights, ids, self.experts)
        return self.forward_torch(x, weights, ids)

    def forward_torch(self, x: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
        """The torch implementation: the CPU path and the kernel's oracle."""
        return fused_moe_torch(x, self.w13_weight, self.w2_weight, weights, ids, self.experts)


def _fused_moe_kernel(use_triton: bool):  # noqa: ANN202 (the kernel's signature is fused_moe's)
    """photon.kernels.fused_moe.fused_moe for a layer built with use_triton (triton is imported
    now), else None."""
    if not use_triton:
        return None
    from photon.kernels.fused_moe import fused_moe

    return fused_moe
