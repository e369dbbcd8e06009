"""Mistral: the Llama graph. Sliding-window attention is not applied (only matters beyond the
window, 4096 tokens for Mistral-7B-v0.1; later Mistral checkpoints set sliding_window null)."""

from __future__ import annotations

from photon.model.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
