"""The runner's side of LoRA: the host cache of adapters and the device slots they load into.

`stage` (host, in prepare) reads a plan's adapters from the host cache (from disk on a miss);
`load` enqueues their copies into the slot weights on the copy stream, ahead of the step's input
upload (the forward waits for that upload's event), from pinned memory on CUDA: the copies overlap
the forward in flight and the host never waits for the device. The scheduler reloads only slots no
step in flight or planned before reads. `launch` sets the step's per-token slots.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from photon.core.step import LoRALoad
from photon.lora.adapter import LoRAAdapter, LoRAError, load_adapter, target_shapes
from photon.lora.config import LoRAConfig
from photon.lora.layers import LoRABatch, LoRAModel
from photon.lora.request import LoRARequest


@dataclass(frozen=True)
class StagedLoad:
    slot: int
    adapter: LoRAAdapter | None  # None: clear the slot


class LoRAHostCache:
    """Adapters in host memory by id, least recently used dropped beyond `capacity`."""

    def __init__(self, capacity: int, hf_config: dict, max_rank: int, pin: bool,
                 targets: set[tuple[int, str]]) -> None:
        self.capacity = capacity
        self.shapes = target_shapes(hf_config)
        self.num_layers = int(hf_config["num_hidden_layers"])
        self.max_rank = max_rank
        self.pin = pin
        self.targets = targets
        self._cache: OrderedDict[int, tuple[str, LoRAAdapter]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter, read and checked on a miss (LoRAError says what is wrong)."""
        hit = self._cache.get(lora.lora_int_id)
        if hit is not None and hit[0] == lora.lora_path:
            self._cache.move_to_end(lora.lora_int_id)
            return hit[1]
        adapter = load_adapter(lora.lora_name, lora.lora_int_id, lora.lora_path, self.max_rank,
                               self.shapes, self.num_layers)
        missing = sorted(set(adapter.weights) - self.targets)
        if missing:
            layer, target = missing[0]
            raise LoRAError(f"LoRA adapter {lora.lora_name!r}: layer {layer} {target} cannot "
                            f"be adapted in this model (its MLP is a mixture of experts)")
        if self.pin:
            adapter.weights = {k: (a.pin_memory(), b.pin_memory())
                               for k, (a, b) in adapter.weights.items()}
        self._cache[lora.lora_int_id] = (lora.lora_path, adapter)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return adapter

    def drop(self, lora_int_id: int) -> None:
        self._cache.pop(lora_int_id, None)


class LoRAWorker:
    def __init__(self, config: LoRAConfig, model: nn.Module, hf_config: dict, max_tokens: int,
                 device: torch.device, dtype: torch.dtype, use_triton: bool) -> None:
        self.batch = LoRABatch(max_tokens, config.num_slots, device, use_triton)
        self.model = LoRAModel(model, self.batch, config.max_lora_rank, device, dtype)
        self.host = LoRAHostCache(config.max_cpu_loras, hf_config, config.max_lora_rank,
                                  device.type == "cuda", self.model.targets)

    def stage(self, loads: list[LoRALoad]) -> tuple[list[StagedLoad], dict[int, str]]:
        """Host half: the plan's adapters from the host cache, and slot -> error for those that
        could not be read (the engine checked each adapter when its request was added; its
        files may have changed since): such a slot is cleared (the base model's zeros)."""
        staged, failed = [], {}
        for load in loads:
            lora = LoRARequest(load.lora_name, load.lora_int_id, load.lora_path)
            try:
                adapter: LoRAAdapter | None = self.host.get(lora)
            except LoRAError as e:
                adapter, failed[load.slot] = None, str(e)
            staged.append(StagedLoad(load.slot, adapter))
        return staged, failed

    def load(self, staged: list[StagedLoad], stream: torch.cuda.Stream | None) -> None:
        """The plan's slot loads, enqueued on `stream` (the copy stream, ahead of the step's
        input upload whose event the forward waits for; None: in order). They overlap the
        forward in flight: no step in flight reads a slot being loaded (the scheduler reloads a
        slot only once its previous adapter's requests are released), and pinned sources are
        kept until their copies ran (the caching host allocator records the stream's use)."""
        if not staged:
            return
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for load in staged:
                self.model.load(load.slot, load.adapter)

    def launch(self, token_slots: torch.Tensor, any_lora: bool) -> None:
        """The step's per-token slots (compute stream), after its slot loads (`load`)."""
        n = token_slots.shape[0]
        self.batch.token_slots[:n].copy_(token_slots)
        self.batch.active = any_lora
        if any_lora:
            self.batch.prepare(n)


def any_adapter(token_slots: np.ndarray) -> bool:
    return bool(token_slots.size) and bool(token_slots.any())
