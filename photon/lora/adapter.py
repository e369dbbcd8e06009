"""Read a PEFT LoRA adapter directory: adapter_config.json and adapter_model.safetensors.

Only safetensors are read (adapter_model.bin is a pickle: loading one can execute code). The
adapter's scaling (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora) is folded into B, so a
layer adds `x @ A.T @ B.T`. Every problem is a `LoRAError` that names the adapter and the field.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

# The projections an adapter may target: attention (q/k/v/o) and the MLP (gate/up/down).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served, and why (the server answers 400)."""


@dataclass(frozen=True)
class ModuleShape:
    in_features: int
    out_features: int


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host: per (layer, target) A [r, in] and B [out, r], B scaled."""

    name: str
    int_id: int
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def target_shapes(hf_config: dict[str, Any]) -> dict[str, ModuleShape]:
    """The full (unsharded) shape of every target projection of a Llama-family model."""
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    inter = int(hf_config["intermediate_size"])
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": ModuleShape(hidden, q), "k_proj": ModuleShape(hidden, kv),
            "v_proj": ModuleShape(hidden, kv), "o_proj": ModuleShape(q, hidden),
            "gate_proj": ModuleShape(hidden, inter), "up_proj": ModuleShape(hidden, inter),
            "down_proj": ModuleShape(inter, hidden)}


def read_config(name: str, path: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from the adapter's config, checked."""
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter {name!r}: lora_path {path!r} is not a directory")
    cfg_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter {name!r}: {path!r} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: {cfg_path} is not readable JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    return _check_config(name, cfg, max_rank)


def _check_config(name: str, cfg: dict[str, Any], max_rank: int) -> tuple[int, float]:
    def bad(key: str, why: str) -> LoRAError:
        return LoRAError(f"LoRA adapter {name!r}: {CONFIG_FILE} field {key!r} {why}")

    if cfg.get("peft_type") != "LORA":
        raise bad("peft_type", f"must be \"LORA\", got {cfg.get('peft_type')!r}")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise bad("r", f"must be a positive integer, got {r!r}")
    if r > max_rank:
        raise bad("r", f"= {r} is above max_lora_rank (--max-lora-rank) = {max_rank}")
    alpha = cfg.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise bad("lora_alpha", f"must be a number, got {alpha!r}")
    for key in ("use_dora", "fan_in_fan_out"):
        if cfg.get(key):
            raise bad(key, "is not supported (must be false)")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if cfg.get(key):
            raise bad(key, "is not supported (must be empty)")
    if cfg.get("bias", "none") != "none":
        raise bad("bias", f"must be \"none\", got {cfg.get('bias')!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted(str(t) for t in targets if str(t).split(".")[-1] not in TARGETS)
        if unsupported:
            raise bad("target_modules", f"names unsupported modules {unsupported}; "
                      f"supported: {', '.join(TARGETS)}")
    elif not isinstance(targets, str):
        raise bad("target_modules", f"must be a list of module names or a regex, got {targets!r}")
    scale = float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)
    return r, scale


def load_adapter(name: str, int_id: int, path: str, max_rank: int,
                 shapes: dict[str, ModuleShape], num_layers: int) -> LoRAAdapter:
    """The adapter's float32 weights on the host, checked against the model's shapes."""
    rank, scale = read_config(name, path, max_rank)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        pickle = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise LoRAError(f"LoRA adapter {name!r}: {path!r} has no {WEIGHTS_FILE}"
                        + (" (adapter_model.bin is a pickle and is never loaded; save the "
                           "adapter with safetensors)" if pickle else ""))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt", device="cpu") as f:
            for key in f.keys():
                layer, target, half = _parse_key(name, key, num_layers)
                halves.setdefault((layer, target), {})[half] = f.get_tensor(key).float()
    except SafetensorError as e:
        raise LoRAError(f"LoRA adapter {name!r}: {weights_path} is not a readable safetensors "
                        f"file: {e}") from e
    adapter = LoRAAdapter(name, int_id, rank)
    for (layer, target), pair in sorted(halves.items()):
        a, b = _check_pair(name, layer, target, pair, rank, shapes[target])
        adapter.weights[(layer, target)] = (a.contiguous(), (b * scale).contiguous())
    if not adapter.weights:
        raise LoRAError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return adapter


def _parse_key(name: str, key: str, num_layers: int) -> tuple[int, str, str]:
    m = _KEY.search(key)
    if m is None or m.group(2) not in TARGETS:
        raise LoRAError(f"LoRA adapter {name!r}: weight {key!r} targets an unsupported module; "
                        f"supported: {', '.join(TARGETS)} of the decoder layers")
    layer = int(m.group(1))
    if layer >= num_layers:
        raise LoRAError(f"LoRA adapter {name!r}: weight {key!r} is for layer {layer}, but the "
                        f"model has {num_layers} layers")
    return layer, m.group(2), m.group(3)


def _check_pair(name: str, layer: int, target: str, pair: dict[str, torch.Tensor], rank: int,
                shape: ModuleShape) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"LoRA adapter {name!r}: layer {layer} {target}"
    if set(pair) != {"A", "B"}:
        raise LoRAError(f"{where} has lora_{'A' if 'A' not in pair else 'B'} missing")
    a, b = pair["A"], pair["B"]
    want_a, want_b = (rank, shape.in_features), (shape.out_features, rank)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise LoRAError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                        f"fit the model (expected {want_a} and {want_b} for r = {rank})")
    return a, b
