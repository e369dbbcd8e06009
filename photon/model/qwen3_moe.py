"""Qwen3-MoE: the Qwen3 graph (q/k norms) with sparse MoE MLPs.

Layer i is sparse when `i not in mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`
(HF's rule); other layers keep a dense MLP of `intermediate_size`. Router: softmax, top
`num_experts_per_tok`, renormalized when `norm_topk_prob`.
"""

from __future__ import annotations

from typing import Any

from photon.model.qwen3 import Qwen3ForCausalLM
from photon.model.sparse_moe import MoEForCausalLM, MoESettings, positive_int


class Qwen3MoeForCausalLM(MoEForCausalLM):
    decoder_flags = staticmethod(Qwen3ForCausalLM.decoder_flags)

    @staticmethod
    def moe_settings(cfg: dict[str, Any]) -> MoESettings:
        return MoESettings(
            num_experts=positive_int(cfg, "num_experts", "num_local_experts"),
            top_k=positive_int(cfg, "num_experts_per_tok"),
            intermediate_size=positive_int(cfg, "moe_intermediate_size"),
            renormalize=bool(cfg.get("norm_topk_prob", False)))

    @classmethod
    def is_sparse_layer(cls, cfg: dict[str, Any], layer_idx: int) -> bool:
        step = int(cfg.get("decoder_sparse_step") or 1)
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        return (layer_idx not in (cfg.get("mlp_only_layers") or []) and num_experts > 0
                and (layer_idx + 1) % step == 0)
