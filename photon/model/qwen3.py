"""Qwen3: the Llama graph with per-head RMSNorm on q and k before rope, explicit head_dim."""

from __future__ import annotations

from typing import Any

from photon.model.llama import DecoderFlags, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def decoder_flags(cfg: dict[str, Any]) -> DecoderFlags:
        bias = bool(cfg.get("attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False)
