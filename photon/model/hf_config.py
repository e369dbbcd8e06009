"""A model directory's config.json: read (a multimodal model's text_config), the fields photon needs
checked, and the architecture picked from the supported ones."""

from __future__ import annotations

import json
import os
from typing import Any

from photon.config import ConfigError
from photon.model.registry import supported_architectures


def load_hf_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"model directory {model_dir!r} has no config.json")
    with open(path, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    return cfg


_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")


def check_required_fields(hf_config: dict[str, Any], model_dir: str) -> None:
    missing = [name for name in _REQUIRED_FIELDS if not isinstance(hf_config.get(name), int)]
    if missing:
        raise ConfigError(f"{os.path.join(model_dir, 'config.json')} lacks integer fields "
                          f"{', '.join(missing)}")


def architecture(hf_config: dict[str, Any]) -> str:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in supported_architectures():
            return arch
    raise ConfigError(
        f"unsupported architecture {archs or '(none given in config.json)'}; "
        f"supported: {', '.join(supported_architectures())}")
