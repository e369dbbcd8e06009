"""Architecture name (config.json `architectures`) -> model class, imported lazily."""

from __future__ import annotations

import importlib

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "photon.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "photon.model.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "photon.model.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "photon.model.qwen3:Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return list(_MODELS)


def get_model_class(arch: str) -> type:
    if arch not in _MODELS:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(supported_architectures())}")
    module_name, cls_name = _MODELS[arch].split(":")
    return getattr(importlib.import_module(module_name), cls_name)
