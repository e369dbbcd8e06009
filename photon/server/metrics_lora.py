"""Prometheus series of LoRA adapters (`--enable-lora`), fed from the `LoRAStats` each step's
EngineStats carries:
- `lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}` (vLLM's): the
  adapters of the running and the waiting requests (names, comma-separated) and --max-loras as
  labels; its value is the time of the update (seconds since the epoch). One series is current:
  a change of labels replaces it (with several API servers, earlier series stay, each with the
  time it was last current, as in vLLM: the newest is the current one);
- gauges `lora_slots_used` (device slots referenced by a request) and `lora_slots_loaded` (slots
  holding an adapter, referenced or idle), and the counter `lora_slot_loads` (adapters loaded
  into a slot: with more adapters in use than slots, the churn).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from photon.lora.manager import LoRAStats


class LoRAMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.info = Gauge("photon:lora_requests_info", "Running stats on LoRA requests.",
                          ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                          registry=registry, multiprocess_mode="livemax")
        self.slots_used = Gauge("photon:lora_slots_used", "LoRA slots referenced by a request.",
                                ["model_name"], registry=registry,
                                multiprocess_mode="livemax").labels(model)
        self.slots_loaded = Gauge("photon:lora_slots_loaded", "LoRA slots holding an adapter.",
                                  ["model_name"], registry=registry,
                                  multiprocess_mode="livemax").labels(model)
        self.slot_loads = Counter("photon:lora_slot_loads", "LoRA adapters loaded into a slot.",
                                  ["model_name"], registry=registry).labels(model)
        self._labels: tuple[str, str, str] | None = None

    def update(self, now: LoRAStats | None, last: LoRAStats | None) -> None:
        if now is None:
            return
        labels = (str(now.max_lora), ",".join(now.waiting_adapters),
                  ",".join(now.running_adapters))
        if labels != self._labels:
            self.info.clear()
            self._labels = labels
        self.info.labels(*labels).set_to_current_time()
        self.slots_used.set(now.slots_used)
        self.slots_loaded.set(now.slots_loaded)
        self.slot_loads.inc(max(0, now.num_slot_loads - (last.num_slot_loads if last else 0)))
