"""--quantization: which linear method each linear layer of the model gets.

`resolve_quant_config` runs once in EngineArgs.create_config: it reads the checkpoint's
config.json `quantization_config` (compressed-tensors) or takes `--quantization fp8` (online),
checks the combination against the model and the device, and returns a frozen QuantConfig whose
`linear_method(module, members)` the model asks while it builds its layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from photon.config import ConfigError, flag
from photon.quant.base import LinearMethod
from photon.registry import Registry

QUANT_CONFIGS: Registry[type] = Registry("quantization method", lazy={
    "fp8": "photon.quant.config:Fp8Config",
    "compressed-tensors": "photon.quant.compressed_tensors:CompressedTensorsConfig",
})
# The dense decoders of photon.model.llama's graph (their linear layers take a linear method).
QUANT_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                       "Qwen3ForCausalLM")
# FP8 tensor cores (torch._scaled_mm): compute capability 8.9 (Ada) and newer.
FP8_MIN_CAPABILITY = (8, 9)


class QuantConfig(ABC):
    name: str = ""

    @classmethod
    @abstractmethod
    def from_checkpoint(cls, checkpoint: dict[str, Any] | None, use_triton: bool
                        ) -> QuantConfig:
        """The config for a model whose config.json has `checkpoint` as quantization_config."""

    @abstractmethod
    def linear_method(self, module: str, members: tuple[str, ...]) -> LinearMethod | None:
        """The method of photon linear `module` (e.g. model.layers.0.self_attn.qkv_proj), which
        packs the checkpoint's modules `members` (q_proj, k_proj, v_proj); None: unquantized."""

    @abstractmethod
    def uses_fp8(self) -> bool:
        """Whether some layer runs FP8 GEMMs (these need FP8 tensor cores on CUDA)."""


class Fp8Config(QuantConfig):
    """Online FP8: every linear layer of the decoder (not the embedding or the LM head)."""

    name = "fp8"

    def __init__(self) -> None:
        from photon.quant.fp8 import Fp8LinearMethod

        self.method = Fp8LinearMethod()

    @classmethod
    def from_checkpoint(cls, checkpoint: dict[str, Any] | None, use_triton: bool
                        ) -> QuantConfig:
        return cls()

    def linear_method(self, module: str, members: tuple[str, ...]) -> LinearMethod | None:
        return self.method

    def uses_fp8(self) -> bool:
        return True


def resolve_quant_config(quantization: str | None, hf_config: dict[str, Any], architecture: str,
                         device: str, use_triton: bool) -> QuantConfig | None:
    """The model's QuantConfig (None: unquantized); ConfigError naming what is wrong."""
    checkpoint = hf_config.get("quantization_config")
    name = _method_name(quantization, checkpoint)
    if name is None:
        return None
    if architecture not in QUANT_ARCHITECTURES:
        raise ConfigError(f"{flag('quantization')}={name}: {architecture} cannot be quantized "
                          f"yet; supported: {', '.join(QUANT_ARCHITECTURES)}")
    config: QuantConfig = QUANT_CONFIGS.get(name).from_checkpoint(checkpoint, use_triton)
    if device == "cuda" and config.uses_fp8():
        check_fp8_capability(torch.cuda.get_device_capability(), config.name)
    return config


def check_fp8_capability(capability: tuple[int, int], scheme: str) -> None:
    if tuple(capability) < FP8_MIN_CAPABILITY:
        need = ".".join(map(str, FP8_MIN_CAPABILITY))
        raise ConfigError(
            f"{scheme}: FP8 GEMMs need a GPU of compute capability {need} or newer (Ada, "
            f"Hopper, Blackwell); this GPU is {capability[0]}.{capability[1]}. On it, use an "
            f"unquantized model, or a W8A8-INT8, W4A16 or W8A16 compressed-tensors checkpoint")


def _method_name(quantization: str | None, checkpoint: object) -> str | None:
    if quantization is not None and quantization not in QUANT_CONFIGS:
        raise ConfigError(f"{flag('quantization')}: {QUANT_CONFIGS.unknown(quantization)}")
    if checkpoint is None:
        if quantization == "compressed-tensors":
            raise ConfigError(f"{flag('quantization')}=compressed-tensors: the model's "
                              f"config.json has no quantization_config")
        return quantization
    found = checkpoint.get("quant_method") if isinstance(checkpoint, dict) else None
    if found != "compressed-tensors":
        raise ConfigError(f"config.json quantization_config: quant_method {found!r} is not "
                          f"supported; photon reads compressed-tensors checkpoints")
    if quantization not in (None, found):
        raise ConfigError(f"{flag('quantization')}={quantization} does not match the "
                          f"checkpoint, which is quantized with {found}: leave "
                          f"{flag('quantization')} unset (or set it to {found}) for this model")
    return found
