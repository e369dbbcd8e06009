"""Multi-LoRA serving: PEFT adapters applied per request, many of them in one batch.

`LoRARequest` names an adapter (vLLM's fields); `photon.lora.adapter` reads a PEFT adapter
directory; `photon.lora.slots` is the scheduler's pool of device slots; `photon.lora.layers`
holds the stacked slot weights and the batched LoRA computation the linear layers run.
"""

from __future__ import annotations

from photon.lora.request import LoRARequest

__all__ = ["LoRARequest"]
