"""Mixtral: the Mistral (Llama) graph with a sparse MoE MLP in every layer.

Router: softmax over the top `num_experts_per_tok` logits (softmax over all, top-k,
renormalized). HF names the block `block_sparse_moe` and an expert's projections w1 (gate),
w3 (up), w2 (down); they load into `mlp.experts.w13_weight` / `w2_weight`. Sliding-window
attention is not applied, as for Mistral.
"""

from __future__ import annotations

from typing import Any

from photon.model.sparse_moe import MoEForCausalLM, MoESettings, positive_int


class MixtralForCausalLM(MoEForCausalLM):
    @staticmethod
    def moe_settings(cfg: dict[str, Any]) -> MoESettings:
        return MoESettings(
            num_experts=positive_int(cfg, "num_local_experts"),
            top_k=positive_int(cfg, "num_experts_per_tok"),
            intermediate_size=positive_int(cfg, "intermediate_size"),
            renormalize=True)

    def map_weight_name(self, hf_name: str) -> tuple[str, Any]:
        return super().map_weight_name(hf_name.replace(".block_sparse_moe.", ".mlp."))
