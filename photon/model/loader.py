"""Build a model from the registry and stream its safetensors checkpoint into it.

Only safetensors are read (no torch.load / pickle: loading a pickle can execute code).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from photon.attention.kv_quant import CheckpointKVScales
from photon.config import ConfigError, ModelConfig
from photon.distributed.dp_experts import DPExperts
from photon.distributed.group import TPGroup
from photon.model.registry import get_model_class


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files to read: the index's shards if there is an index, else all."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f).get("weight_map", {})
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        for path in files:
            if not os.path.isfile(path):
                raise ConfigError(f"{index_path} names shard {os.path.basename(path)!r}, "
                                  f"which is missing from {model_dir}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ConfigError(
            f"model directory {model_dir!r} has no *.safetensors files; photon only loads "
            "safetensors checkpoints (.bin/.pt pickle checkpoints are not loaded; convert them)")
    return files


def _keeps_dtype(name: str, tensor: torch.Tensor) -> bool:
    """Quantized checkpoints' FP8 weights and float32 scales are read as stored."""
    return tensor.element_size() == 1 or name.endswith("_scale")


def iter_weights(files: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor, one at a time; floating tensors are cast to dtype,
    except FP8 tensors and quantization scales (`*_scale`)."""
    for path in files:
        try:
            f = safe_open(path, framework="pt", device="cpu")
        except SafetensorError as e:
            raise ConfigError(f"{path} is not a readable safetensors file: {e}") from e
        with f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and not _keeps_dtype(name, tensor):
                    tensor = tensor.to(dtype)
                yield name, tensor


def load_model(model_config: ModelConfig, device: str, tp: TPGroup | None = None,
               expert_parallel: bool = False,
               kv_scales: CheckpointKVScales | None = None,
               dp_experts: DPExperts | None = None) -> nn.Module:
    """The model on `device`; with a tensor-parallel group of more than one rank, this rank's
    shards only (each checkpoint tensor is sliced as it is read). expert_parallel (MoE models
    only; checked by ParallelConfig): each rank holds whole experts, a share of them.
    kv_scales: receives the checkpoint's KV cache scales (k_scale / v_scale), which are not
    weights of the model (dropped when None). dp_experts (MoE models only): the experts are
    partitioned over the data-parallel cores of that group; this core loads only its share."""
    cls = get_model_class(model_config.architecture)
    torch_device = torch.device(device)
    # One rank: the model classes' own signature (those without tensor parallelism take no tp).
    parallel: dict[str, object] = {"tp": tp} if tp is not None and tp.size > 1 else {}
    if parallel and expert_parallel:
        parallel["expert_parallel"] = True
    if dp_experts is not None:
        parallel["dp_experts"] = dp_experts
    if model_config.quant_config is not None:
        parallel["quant_config"] = model_config.quant_config
    with torch_device:
        model = cls(model_config.hf_config, model_config.dtype, torch_device,
                    use_triton=model_config.use_triton, **parallel)
    if model_config.load_format == "dummy":
        _init_dummy(model, model_config.seed)
    else:
        _load_checkpoint(model, model_config, kv_scales or CheckpointKVScales())
    _process_quantized(model)
    model.eval()
    model.requires_grad_(False)
    return model


def _load_checkpoint(model: nn.Module, model_config: ModelConfig,
                     kv_scales: CheckpointKVScales) -> None:
    files = checkpoint_files(model_config.model)
    loaded = model.load_weights(kv_scales.filter(iter_weights(files, model_config.dtype)))
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (f" ... ({len(missing)} in all)" if len(missing) > 10 else "")
        raise ConfigError(f"checkpoint in {model_config.model!r} is missing weights: {shown}")


def _process_quantized(model: nn.Module) -> None:
    """Each quantized linear's method finishes its weights (online FP8 quantizes them here)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights(module)


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int) -> None:
    """load_format="dummy" (vLLM's name): random weights of the right shapes, no checkpoint read.
    For benchmarks of model shapes; matrices ~N(0, 0.02), norms 1, biases 0; quantized integer
    tensors uniform over their dtype, FP8 weights ~N(0, 0.02) cast to FP8."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if not param.is_floating_point() or param.element_size() == 1:
            _init_dummy_quantized(param, gen)
        elif param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)


def _init_dummy_quantized(param: nn.Parameter, gen: torch.Generator) -> None:
    if param.is_floating_point():  # FP8
        param.copy_(torch.empty(param.shape, device=param.device).normal_(0.0, 0.02,
                                                                           generator=gen))
        return
    info = torch.iinfo(param.dtype)
    param.copy_(torch.randint(info.min, info.max, param.shape, generator=gen,
                              device=param.device, dtype=torch.int64).to(param.dtype))
