"""LoRARegistry: the adapters a server serves by name, owned by the engine core.

The registry lives in the engine core (one per core), not in the API servers: every API server of
`photon serve --api-server-count N` sends its loads and unloads there (utility calls), and asks
there for the names it does not know, so a change made through one API server is seen by all.
`version` grows with every change; the core's stats carry it, so an API server can tell that its
copy of the names is out of date.

Ids: `--lora-modules` take 1, 2, ... in order; each load takes the next unused id, never one an
unloaded adapter had (a request still running with it keeps its slot and host copy until it
finishes; a new adapter of the same name is another adapter).
"""

from __future__ import annotations

import os

import msgspec

from photon.lora.request import LoRARequest


class LoRAAdapters(msgspec.Struct):
    """The registry's adapters (a utility call's answer); for a load or unload also whether it
    was refused: `error` says why, `not_found` marks a name or path that does not exist."""

    version: int
    adapters: list[LoRARequest]
    error: str | None = None
    not_found: bool = False


class LoRARegistry:
    def __init__(self, modules: tuple[LoRARequest, ...], base_model_name: str) -> None:
        self.base_model_name = base_model_name
        self._by_name: dict[str, LoRARequest] = {m.lora_name: m for m in modules}
        self._next_id = max((m.lora_int_id for m in modules), default=0) + 1
        self.unloaded: set[int] = set()  # ids unloaded while requests still used them
        self.version = 0

    def snapshot(self, error: str | None = None, not_found: bool = False) -> LoRAAdapters:
        return LoRAAdapters(self.version, list(self._by_name.values()), error, not_found)

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def new_request(self, name: str, path: str) -> LoRARequest | LoRAAdapters:
        """The LoRARequest a load would register, or the refusal (as vLLM's checks: both
        fields given, a new name)."""
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return self.snapshot("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base_model_name:
            return self.snapshot(f"lora_name {name!r} is the base model's name; give the "
                                 f"adapter another name")
        if name in self._by_name:
            return self.snapshot(f"The lora adapter '{name}' has already been loaded; unload "
                                 f"it first (POST /v1/unload_lora_adapter) to replace it.")
        if not os.path.exists(path):
            return self.snapshot(f"LoRA adapter {name!r}: no adapter found at lora_path "
                                 f"{path!r} (no such file or directory)", not_found=True)
        return LoRARequest(name, self._next_id, path)

    def add(self, lora: LoRARequest) -> None:
        self._by_name[lora.lora_name] = lora
        self._next_id = max(self._next_id, lora.lora_int_id + 1)
        self.version += 1

    def remove(self, name: str) -> LoRARequest | None:
        lora = self._by_name.pop(name, None) if isinstance(name, str) else None
        if lora is not None:
            self.version += 1
        return lora
