"""How many KV blocks a runner allocates: from an override, a byte budget, or the GPU's free memory."""

from __future__ import annotations

import math

import torch

from photon.config import EngineConfig, flag

CPU_DEFAULT_KV_BYTES = 256 << 20


def usable_blocks(config: EngineConfig, device: torch.device, block_bytes: int
                  ) -> tuple[int, str]:
    """The KV blocks requests can use, and what raises their number."""
    cache = config.cache
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override, f"raise {flag('num_gpu_blocks_override')}"
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
        remedy = f"raise {flag('kv_cache_memory_bytes')}"
    elif device.type == "cuda":
        budget = cuda_kv_budget(config, device)
        remedy = f"raise {flag('gpu_memory_utilization')} (or free GPU memory)"
    else:
        budget = CPU_DEFAULT_KV_BYTES
        remedy = (f"set {flag('kv_cache_memory_bytes')} above the CPU default of "
                  f"{CPU_DEFAULT_KV_BYTES >> 20} MiB")
    sched = config.scheduler
    useful = sched.max_num_seqs * math.ceil(config.model.max_model_len / config.cache.block_size)
    return max(0, min(budget // block_bytes - 1, useful)), remedy


def lora_headroom(config: EngineConfig) -> int:
    """Bytes of the largest LoRA shrink output of a full token budget (float32 partial sums,
    one per K chunk: photon.kernels.lora), 0 without LoRA."""
    if config.lora_config is None:
        return 0
    from photon.kernels.lora import SPLIT_K

    hf, rank = config.model.hf_config, config.lora_config.max_lora_rank
    hidden = int(hf["hidden_size"])
    inter = int(hf.get("intermediate_size") or hidden)
    width = max(math.ceil(hidden / SPLIT_K) * 3 * rank, math.ceil(inter / SPLIT_K) * rank)
    return width * config.scheduler.max_num_batched_tokens * 4


def cuda_kv_budget(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV cache on a GPU: the --gpu-memory-utilization share of its memory, less
    what other processes and this one use and an activation headroom."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_allocated(device)
    # Activation headroom: logits of a full batch (fp32, a few copies in the sampler) plus the
    # hidden states of a full token budget, with margin.
    sched, mc = config.scheduler, config.model
    act = 6 * sched.max_num_seqs * mc.vocab_size * 4
    act += 24 * sched.max_num_batched_tokens * int(mc.hf_config["hidden_size"]) * 4
    act += lora_headroom(config)
    budget = int(total * config.cache.gpu_memory_utilization) - used_by_others
    budget -= torch.cuda.memory_allocated(device) + act + (1 << 30)
    return max(budget, 0)
