"""Architecture name (config.json `architectures`) -> model class, imported lazily."""

from __future__ import annotations

from photon.registry import Registry

MODELS: Registry[type] = Registry("model architecture", lazy={
    "LlamaForCausalLM": "photon.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "photon.model.mistral:MistralForCausalLM",
    "MixtralForCausalLM": "photon.model.mixtral:MixtralForCausalLM",
    "Qwen2ForCausalLM": "photon.model.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "photon.model.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "photon.model.qwen3_moe:Qwen3MoeForCausalLM",
})
supported_architectures = MODELS.names
get_model_class = MODELS.get
