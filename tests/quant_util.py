"""Helpers for the quantization tests: quantized photon-tiny checkpoints, and the reference path
(a plain float model holding the dequantized weights, its linears' inputs fake-quantized)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from photon.model.layers.linear import QuantizableLinear
from photon.model.tiny import PHOTON_TINY, builtin_model_path
from photon.quant import numerics as qn
from photon.quant.quantize import make_scheme, quantize_model

PROMPTS_FILE = Path(__file__).parent / "data" / "heldout_code.json"
SCHEMES = ("fp8-dynamic", "fp8-static", "w8a8-int8", "w4a16", "w8a16")


def heldout() -> list[list[int]]:
    return [p["token_ids"] for p in json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))]


def quantized_tiny(out: str, scheme: str, **kw: object) -> str:
    """photon-tiny quantized with `scheme` into out (calibrated on the first 4 held-out
    prompts, which the agreement checks leave out)."""
    quantize_model(builtin_model_path(PHOTON_TINY), out, make_scheme(scheme, **kw),
                   heldout()[:4])
    return out


def dequantized_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A compressed-tensors state dict -> float32 weights (what the reference path multiplies
    by), activation scales dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and f"{module}.weight_scale" in tensors:
            out[name] = t.float() * tensors[f"{module}.weight_scale"].float()
        elif leaf == "weight_packed":
            out[f"{module}.weight"] = _dequant_packed(tensors, module)
        elif not leaf.endswith(("_scale", "_shape", "_zero_point")):
            out[name] = t
    return out


def _dequant_packed(tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    n, k = tensors[f"{module}.weight_shape"].tolist()
    packed = tensors[f"{module}.weight_packed"]
    bits = 32 // (k // packed.shape[1])  # k / packed columns = values per int32 word
    q = qn.unpack_int32(packed, bits, k)
    zp = tensors.get(f"{module}.weight_zero_point")
    scale = tensors[f"{module}.weight_scale"].float()
    zero = None if zp is None else qn.unpack_int32(zp, bits, n, dim=0)
    return qn.dequantize_groups(q, scale, zero, torch.float32)


def write_dequantized(quant_dir: str, out: str) -> str:
    """A plain float32 checkpoint of quant_dir's dequantized weights."""
    os.makedirs(out, exist_ok=True)
    tensors = load_file(os.path.join(quant_dir, "model.safetensors"))
    save_file(dequantized_tensors(tensors), os.path.join(out, "model.safetensors"))
    for name in os.listdir(quant_dir):
        if name.endswith(".json") and name != "config.json":
            Path(out, name).write_bytes(Path(quant_dir, name).read_bytes())
    config = json.loads(Path(quant_dir, "config.json").read_text(encoding="utf-8"))
    config.pop("quantization_config")
    Path(out, "config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


def fake_quant(scheme: str, input_scales: dict[str, float]) -> Callable[..., torch.Tensor]:
    """The activations' quantize-dequantize of `scheme` for one linear's input [M, K]."""
    def per_token(fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                  ) -> Callable[..., torch.Tensor]:
        return lambda x, name: (lambda q, s: (q.float() * s).to(x.dtype))(*fn(x))

    if scheme == "fp8-dynamic":
        return per_token(qn.per_token_fp8)
    if scheme == "w8a8-int8":
        return per_token(qn.per_token_int8)
    if scheme == "fp8-static":
        def static(x: torch.Tensor, name: str) -> torch.Tensor:
            s = torch.tensor(input_scales[name]).reshape(1, 1)
            return (qn.to_fp8(x, s).float() * s).to(x.dtype)
        return static
    return lambda x, name: x


@contextmanager
def reference_hooks(model: nn.Module, scheme: str, input_scales: dict[str, float]
                    ) -> Iterator[None]:
    """Fake-quantize every linear's input as `scheme`'s activations are quantized."""
    fq = fake_quant(scheme, input_scales)
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizableLinear):
            hooks.append(module.register_forward_pre_hook(
                lambda _m, args, name=name: (fq(args[0], name),)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def photon_input_scales(quant_dir: str) -> dict[str, float]:
    """photon module name (…qkv_proj) -> the static input scale of the modules it packs."""
    tensors = load_file(os.path.join(quant_dir, "model.safetensors"))
    renames = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    out: dict[str, float] = {}
    for name, t in tensors.items():
        if name.endswith(".input_scale"):
            prefix, _, leaf = name[:-len(".input_scale")].rpartition(".")
            key = f"{prefix}.{renames.get(leaf, leaf)}"
            out[key] = max(out.get(key, 0.0), float(t))
    return out
