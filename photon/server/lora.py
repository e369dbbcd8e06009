"""LoRA adapters by name: the request's `model`, /v1/models, /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's endpoints, messages and statuses).

The registry of names lives in the engine core (photon.lora.registry), so that every API server
of `photon serve --api-server-count N` sees every load and unload. Each API server keeps a copy of
it (`AdapterNames`) and asks the core again when the copy may be out of date: for a name it does
not know (loaded through another API server) and when the core's stats carry a newer registry
version (an unload through another API server). A request that races an unload made through
another API server is refused by the core (its id was unloaded): the engine's add_request raises
AdapterNotFoundError, and the request gets the same 404 as any unknown model, streamed or not.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from photon.engine.async_engine import AsyncEngine
from photon.engine.async_llm import AsyncLLM
from photon.lora.registry import LoRAAdapters
from photon.lora.request import LoRARequest
from photon.server.errors import APIError


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model",
                    code="model_not_found")


class AdapterNames:
    """This API server's copy of the core's adapter registry."""

    def __init__(self, engine: AsyncEngine | AsyncLLM, base_model_name: str,
                 enabled: bool) -> None:
        self.engine = engine
        self.base = base_model_name
        self.enabled = enabled  # --enable-lora
        self._by_name: dict[str, LoRARequest] = {}
        self._version = -1  # never fetched

    async def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for any other
        name."""
        if name is None or name == self.base:
            return None
        if not self.enabled:
            raise model_not_found(name)
        lora = self._by_name.get(name)
        if lora is None or self._version < self.engine.counters.lora_version:
            await self.refresh()
            lora = self._by_name.get(name)
        if lora is None:
            raise model_not_found(name)
        return lora

    async def adapters(self) -> list[LoRARequest]:
        """Every adapter, as the core has them now."""
        if not self.enabled:
            return []
        await self.refresh()
        return list(self._by_name.values())

    async def refresh(self) -> None:
        self._take(await self._call("list_lora_adapters"))

    async def load(self, name: str, path: str) -> str:
        """Register an adapter in the core (checked there); vLLM's success text."""
        result = await self._update("load_lora_adapter", name, path)
        return f"Success: LoRA adapter '{result}' added successfully."

    async def unload(self, name: str) -> str:
        result = await self._update("unload_lora_adapter", name)
        return f"Success: LoRA adapter '{result}' removed successfully."

    async def _update(self, method: str, *args: str) -> str:
        if not self.enabled:
            raise APIError(400, "LoRA adapters need a server started with --enable-lora",
                           param="lora_name")
        result = await self._call(method, *args)
        self._take(result)
        if result.error is not None:
            param = "lora_path" if method == "load_lora_adapter" and result.not_found \
                else "lora_name"
            raise APIError(404 if result.not_found else 400, result.error, param=param,
                           code="lora_adapter_not_found" if result.not_found else None)
        return args[0]

    async def _call(self, method: str, *args: str) -> LoRAAdapters:
        return await asyncio.to_thread(self.engine.call_utility, method, 30.0, args)

    def _take(self, result: LoRAAdapters) -> None:
        if result.version >= self._version:
            self._by_name = {lora.lora_name: lora for lora in result.adapters}
            self._version = result.version


def model_cards(base: dict[str, Any], adapters: list[LoRARequest]) -> list[dict[str, Any]]:
    """/v1/models' data: the base model, then each adapter with `parent` (vLLM's cards)."""
    created = int(time.time())
    cards = [{**base, "object": "model", "created": created, "owned_by": "photon",
              "parent": None}]
    for lora in adapters:
        cards.append({"id": lora.lora_name, "object": "model", "created": created,
                      "owned_by": "photon", "root": lora.lora_path, "parent": base["id"],
                      "max_model_len": base.get("max_model_len")})
    return cards
