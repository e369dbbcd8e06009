"""Qwen2: the Llama graph with biases on q/k/v (never on o_proj)."""

from __future__ import annotations

from typing import Any

from photon.model.llama import DecoderFlags, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def decoder_flags(cfg: dict[str, Any]) -> DecoderFlags:
        return DecoderFlags(qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)
