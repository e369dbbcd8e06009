"""How `EngineArgs.create_config()` resolves each argument: the device, dtype and context
length from the checkpoint, and the optional features' configs from their own modules (each
import deferred, so a feature's dependencies load only when it is used)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from photon.config import ConfigError, ParallelConfig, check_choice, check_positive
from photon.reasoning import get_reasoning_parser

if TYPE_CHECKING:
    from photon.engine_args import EngineArgs
    from photon.kv_events.config import KVEventsConfig
    from photon.kv_transfer.config import KVTransferConfig
    from photon.lora.config import LoRAConfig
    from photon.quant.config import QuantConfig
    from photon.spec.config import SpeculativeConfig

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
DEVICES = ("auto", "cuda", "cpu")


def default_name(model: str | None, model_dir: str) -> str:
    from photon.model.tiny import BUILTIN_MODELS, PHOTON_TINY

    if model is None or model in BUILTIN_MODELS:
        return model or PHOTON_TINY
    # A local directory is named by its folder, a hub id by itself (its snapshot folder is a hash).
    return os.path.basename(model_dir.rstrip("/")) if os.path.isdir(model) else model


def reasoning_parser(name: str | None) -> str | None:
    if name is None:
        return None
    try:
        return get_reasoning_parser(name).name
    except ValueError as e:
        raise ConfigError(f"reasoning_parser: {e}") from None


def quant_config(quantization: str | None, hf_config: dict[str, Any], arch: str, device: str,
                  use_triton: bool) -> QuantConfig | None:
    from photon.quant.config import resolve_quant_config

    return resolve_quant_config(quantization, hf_config, arch, device, use_triton)


def lora_config(args: EngineArgs) -> LoRAConfig | None:
    from photon.lora.config import make_lora_config

    try:
        return make_lora_config(args.enable_lora, args.max_loras, args.max_lora_rank,
                                args.max_cpu_loras, args.lora_modules)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def speculative_config(value: object) -> SpeculativeConfig | None:
    from photon.spec.config import parse_speculative_config

    return parse_speculative_config(value)


def kv_events_config(value: object) -> KVEventsConfig | None:
    from photon.kv_events.config import parse_kv_events_config

    return parse_kv_events_config(value)


def kv_transfer_config(value: object, tensor_parallel_size: int) -> KVTransferConfig | None:
    from photon.kv_transfer.config import FLAG, parse_kv_transfer_config
    from photon.kv_transfer.registry import KV_CONNECTORS

    config = parse_kv_transfer_config(value)
    if config is not None:
        KV_CONNECTORS.get(config.kv_connector).check_config(config, tensor_parallel_size)
    port = 0 if config is None else config.extra.kv_port
    if port and port + tensor_parallel_size - 1 > 65535:  # rank r listens on kv_port + r
        raise ConfigError(f"{FLAG}: kv_connector_extra_config.kv_port {port} leaves no port "
                          f"for each of the {tensor_parallel_size} ranks (rank r listens on "
                          f"kv_port + r, at most 65535); choose a lower one or 0 (free ports)")
    return config


def parallel_config(parallel: ParallelConfig, architecture: str,
                     hf_config: dict[str, Any]) -> ParallelConfig:
    if parallel.distributed_executor_backend == "ray":
        from photon.distributed.ray_launcher import check_ray_installed

        check_ray_installed()
    parallel.check_expert_parallel(architecture)
    parallel.check_model(architecture, hf_config)
    parallel.check_experts_span_cores(architecture, hf_config)
    return parallel


def attention_backend(name: str, device: str) -> str:
    """The backend the runner builds: `auto` resolved for the device, other names checked."""
    from photon.attention.backend import resolve_backend_name

    try:
        return resolve_backend_name(name, device)
    except ValueError as e:
        raise ConfigError(f"attention_backend: {e}") from None


def resolve_use_triton(device: str) -> bool:
    """Whether the model's layers run photon.kernels' Triton kernels: on CUDA when triton
    imports, unless the process environment has PHOTON_TRITON=0 (the way back to the torch ops,
    e.g. to compare them). Read by create_config, once per engine; never at import."""
    from photon.kernels import has_triton

    return device == "cuda" and has_triton() and os.environ.get("PHOTON_TRITON", "1") != "0"


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    check_choice("device", device, DEVICES)
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is available")
    return device


def resolve_dtype(dtype: str, hf_config: dict[str, Any], device: str) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        return DTYPES[dtype]
    if device == "cpu":
        return torch.float32
    ckpt = DTYPES.get(str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"))
    return torch.bfloat16 if ckpt in (None, torch.float32) else ckpt


def resolve_max_len(max_model_len: int | None, hf_config: dict[str, Any]) -> int:
    limit = int(hf_config.get("max_position_embeddings") or 2048)
    if max_model_len is None:
        return limit
    check_positive("max_model_len", max_model_len)
    if max_model_len > limit:
        raise ConfigError(
            f"max_model_len={max_model_len} is larger than the model's "
            f"max_position_embeddings={limit}")
    return max_model_len
