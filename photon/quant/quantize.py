"""`photon quantize`: write a compressed-tensors checkpoint of a photon-loadable model.

The decoder's linear weights are quantized by round-to-nearest with per-channel (W8A8) or group
(W4A16 / W8A16) scales; embeddings, norms and the LM head are copied as they are. The config
keys and tensor names are llm-compressor's, so photon (and other compressed-tensors readers) load
the result. fp8-static also records each linear's input scale from a calibration pass.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from photon.config import ConfigError
from photon.model.hf_config import architecture, load_hf_config
from photon.model.loader import checkpoint_files
from photon.quant import numerics as qn
from photon.quant.config import QUANT_ARCHITECTURES

LINEAR = re.compile(r"^(model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj))"
                    r"\.weight$")
DEFAULT_GROUP_SIZE = 128


def _args(num_bits: int, kind: str, strategy: str, dynamic: bool, symmetric: bool = True,
          group_size: int | None = None) -> dict[str, Any]:
    return {"num_bits": num_bits, "type": kind, "strategy": strategy, "symmetric": symmetric,
            "dynamic": dynamic, "group_size": group_size, "actorder": None,
            "block_structure": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}}


@dataclass(frozen=True)
class Scheme:
    format: str
    weights: dict[str, Any]
    input_activations: dict[str, Any] | None
    # Quantizes one weight [N, K] (float32) into its checkpoint tensors, keyed by suffix.
    quantize: Callable[[torch.Tensor], dict[str, torch.Tensor]]

    @property
    def static_input(self) -> bool:
        return self.input_activations is not None and not self.input_activations["dynamic"]


def _w8a8(w: torch.Tensor, fp8: bool) -> dict[str, torch.Tensor]:
    if fp8:
        q, scale = qn.per_channel_fp8(w)
    else:
        scale = (w.abs().amax(dim=1, keepdim=True) / qn.INT8_MAX).clamp_min(qn.MIN_SCALE)
        q = qn.to_int(w, scale, -127, 127)
    return {"weight": q, "weight_scale": scale}


def _wna16(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> dict[str, torch.Tensor]:
    if w.shape[1] % group:
        raise ConfigError(f"--group-size {group} does not divide a linear's input size "
                          f"{w.shape[1]}")
    scale, zero = qn.group_scales(w, bits, group, symmetric)
    q = qn.quantize_groups(w, scale, zero, bits)
    out = {"weight_packed": qn.pack_int32(q, bits), "weight_scale": scale,
           "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if zero is not None:
        out["weight_zero_point"] = qn.pack_int32(zero, bits, dim=0)
    return out


def make_scheme(name: str, group_size: int = DEFAULT_GROUP_SIZE,
                symmetric: bool = True) -> Scheme:
    """The scheme `photon quantize --scheme name` writes (ConfigError for an unknown name)."""
    if name in ("fp8-dynamic", "fp8-static"):
        static = name == "fp8-static"
        acts = _args(8, "float", "tensor" if static else "token", dynamic=not static)
        return Scheme("float-quantized", _args(8, "float", "channel", False), acts,
                      lambda w: _w8a8(w, fp8=True))
    if name == "w8a8-int8":
        return Scheme("int-quantized", _args(8, "int", "channel", False),
                      _args(8, "int", "token", True), lambda w: _w8a8(w, fp8=False))
    if name in ("w4a16", "w8a16"):
        bits = 4 if name == "w4a16" else 8
        return Scheme("pack-quantized",
                      _args(bits, "int", "group", False, symmetric, group_size), None,
                      lambda w: _wna16(w, bits, group_size, symmetric))
    raise ConfigError(f"--scheme must be one of {', '.join(SCHEMES)}; got {name!r}")


SCHEMES = ("fp8-dynamic", "fp8-static", "w8a8-int8", "w4a16", "w8a16")


def quantization_config(scheme: Scheme) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors", "format": scheme.format,
        "quantization_status": "compressed", "global_compression_ratio": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme.weights,
                                      "input_activations": scheme.input_activations,
                                      "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
    }


def quantize_model(model_dir: str, out_dir: str, scheme: Scheme,
                   calibration: list[list[int]] | None = None) -> None:
    """Write `out_dir`: model_dir's files with its linears quantized by `scheme` (calibration:
    token-id lists for static input scales)."""
    hf = load_hf_config(model_dir)
    arch = architecture(hf)
    if arch not in QUANT_ARCHITECTURES:
        raise ConfigError(f"{arch} cannot be quantized yet; supported: "
                          f"{', '.join(QUANT_ARCHITECTURES)}")
    if hf.get("quantization_config"):
        raise ConfigError(f"{model_dir} is already quantized (its config.json has a "
                          f"quantization_config)")
    amax = _calibrate(model_dir, scheme, calibration)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in _read(model_dir):
        match = LINEAR.match(name)
        if match is None:
            tensors[name] = tensor
            continue
        module = match.group(1)
        tensors.update({f"{module}.{k}": v for k, v in scheme.quantize(tensor.float()).items()})
        if scheme.static_input:
            tensors[f"{module}.input_scale"] = qn.fp8_scale(torch.tensor([amax[module]]))
    _write(model_dir, out_dir, hf, tensors, scheme)


def _calibrate(model_dir: str, scheme: Scheme, calibration: list[list[int]] | None
               ) -> dict[str, float]:
    if not scheme.static_input:
        return {}
    if not calibration:
        raise ConfigError("fp8-static needs calibration text (--calibration-file) for its "
                          "static activation scales")
    from photon.quant.calibrate import float_model, input_amax

    return input_amax(float_model(model_dir), calibration)


def _read(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    out = []
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            out += [(name, f.get_tensor(name)) for name in f.keys()]
    return out


def _write(model_dir: str, out_dir: str, hf: dict[str, Any], tensors: dict[str, torch.Tensor],
           scheme: Scheme) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(model_dir):
        src = os.path.join(model_dir, name)
        if os.path.isfile(src) and not name.endswith(".safetensors") \
                and name not in ("config.json", "model.safetensors.index.json"):
            shutil.copyfile(src, os.path.join(out_dir, name))
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = {**hf, "quantization_config": quantization_config(scheme)}
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
