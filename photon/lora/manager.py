"""EngineLoRA: the engine core's side of LoRA outside the step: requests' adapters checked,
the server's registry of names (loads and unloads at run time), and the LoRA stats.

Unloading an adapter that requests still use (running, waiting, or finished but still read by
a step in flight) removes its name at once (new requests for it get 404) and refuses its id
for new requests; its slot and host copy are freed once the last of those requests is released
(`free_unloaded`, after every step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from photon.errors import AdapterNotFoundError
from photon.lora.registry import LoRAAdapters, LoRARegistry
from photon.lora.request import LoRARequest

if TYPE_CHECKING:
    from photon.engine.scheduler import Scheduler
    from photon.lora.config import LoRAConfig
    from photon.lora.worker import LoRAWorker


@dataclass
class LoRAStats:
    """LoRA in an engine stats snapshot (vLLM's lora_requests_info, and slot usage)."""

    running_adapters: list[str] = field(default_factory=list)  # names, sorted
    waiting_adapters: list[str] = field(default_factory=list)
    max_lora: int = 0  # --max-loras: the slots
    slots_used: int = 0  # slots referenced by a request
    slots_loaded: int = 0  # slots holding an adapter (used or idle)
    num_slot_loads: int = 0  # adapters loaded into a slot (cumulative)
    adapters_version: int = 0  # LoRARegistry.version: grows with every load and unload


class EngineLoRA:
    def __init__(self, config: LoRAConfig | None, scheduler: Scheduler,
                 worker: LoRAWorker | None, base_model_name: str) -> None:
        self.config = config
        self.scheduler = scheduler
        self.worker = worker
        self.registry = LoRARegistry(config.lora_modules if config else (), base_model_name)
        self._known: dict[int, LoRARequest] = {}  # the adapters requests named, by id
        self.retired: set[int] = set()  # ids of unloaded adapters (refused for new requests)
        self.freeing: dict[int, LoRARequest] = {}  # unloaded while requests used them

    def check(self, lora: LoRARequest | None) -> None:
        """A request's adapter, checked (ValueError naming what is wrong): LoRA is enabled, its
        id names one adapter that was not unloaded, and its files are a servable PEFT adapter
        (read into the host cache now, so its first step does not read the disk)."""
        if lora is None:
            return
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if self.worker is None:
            raise ValueError("lora_request: this engine was started without enable_lora "
                             "(--enable-lora)")
        if lora.lora_int_id in self.retired:
            raise AdapterNotFoundError(lora.lora_name, f"lora_request: the LoRA adapter "
                                       f"{lora.lora_name!r} (id {lora.lora_int_id}) was unloaded")
        known = self._known.get(lora.lora_int_id)
        if known is not None and known != lora:
            raise ValueError(f"lora_request: lora_int_id {lora.lora_int_id} already names "
                             f"adapter {known.lora_name!r} at {known.lora_path!r}; give each "
                             f"adapter its own id")
        self.worker.host.get(lora)
        self._known[lora.lora_int_id] = lora

    # ---- the registry (utility calls) ---------------------------------------------------------
    def load(self, name: str, path: str) -> LoRAAdapters:
        """Register adapter `name` at `path`, checked as a request's adapter is."""
        if self.worker is None:
            return self.registry.snapshot("LoRA adapters need a server started with "
                                          "--enable-lora")
        lora = self.registry.new_request(name, path)
        if isinstance(lora, LoRAAdapters):
            return lora
        try:
            self.check(lora)
        except ValueError as e:
            return self.registry.snapshot(str(e))
        self.registry.add(lora)
        return self.registry.snapshot()

    def unload(self, name: str) -> LoRAAdapters:
        """Remove adapter `name`: at once from the names; its slot and host copy once no
        request uses it."""
        lora = self.registry.remove(name)
        if lora is None:
            return self.registry.snapshot(f"The lora adapter '{name}' cannot be found.",
                                          not_found=True)
        self.retired.add(lora.lora_int_id)
        self.freeing[lora.lora_int_id] = lora
        self.free_unloaded()
        return self.registry.snapshot()

    def free_unloaded(self) -> None:
        """Free the slot and host copy of every unloaded adapter no request uses any more (a
        request holds its slot until it is released: after its last step in flight)."""
        if not self.freeing:
            return
        in_use = {r.lora_request.lora_int_id for r in self.scheduler.requests.values()
                  if r.lora_request is not None}
        for lora_id in [i for i in self.freeing if i not in in_use]:
            if self.scheduler.lora is not None and not self.scheduler.lora.forget(lora_id):
                continue  # still referenced (cannot happen once its requests are released)
            self.worker.host.drop(lora_id)
            self._known.pop(lora_id, None)
            del self.freeing[lora_id]

    def stats(self) -> LoRAStats | None:
        pool = self.scheduler.lora
        if pool is None:
            return None
        sched = self.scheduler
        return LoRAStats(_names(sched.running), _names([*sched.waiting, *sched.grammar_waiting]),
                         pool.max_loras, pool.num_used, len(pool.resident()), pool.num_loads,
                         self.registry.version)


def _names(requests: list) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
