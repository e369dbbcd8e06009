"""LoRAConfig: the checked --enable-lora family of engine arguments."""

from __future__ import annotations

from dataclasses import dataclass

from photon.lora.request import LoRARequest

MAX_LORA_RANK_LIMIT = 256


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapters resident on the device at once: the slots (slot 0: none)
    max_lora_rank: int = 16  # the stacked slot weights' rank; adapters of lower rank pad
    max_cpu_loras: int = 1  # adapters kept in host memory (LRU); at least max_loras
    # --lora-modules: adapters known at startup, by name (ids 1, 2, ... in the given order)
    lora_modules: tuple[LoRARequest, ...] = ()

    @property
    def num_slots(self) -> int:
        """Rows of the stacked slot weights: slot 0 (no adapter, zero weights) and max_loras."""
        return self.max_loras + 1


def parse_lora_modules(values: list[str] | tuple[str, ...] | None) -> tuple[LoRARequest, ...]:
    """`name=path` entries (vLLM's --lora-modules) -> LoRARequests with ids 1, 2, ...
    (ValueError naming the bad entry)."""
    out: list[LoRARequest] = []
    seen: set[str] = set()
    for entry in values or ():
        name, sep, path = str(entry).partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules (--lora-modules): expected name=path, got {entry!r}")
        if name in seen:
            raise ValueError(f"lora_modules (--lora-modules): the name {name!r} is given twice")
        seen.add(name)
        out.append(LoRARequest(name, len(out) + 1, path))
    return tuple(out)


def make_lora_config(enable_lora: bool, max_loras: int, max_lora_rank: int,
                     max_cpu_loras: int | None, lora_modules: list[str] | None
                     ) -> LoRAConfig | None:
    """The checked LoRAConfig (None without --enable-lora; ValueError naming the flag)."""
    if not enable_lora:
        if lora_modules:
            raise ValueError("lora_modules (--lora-modules) needs enable_lora (--enable-lora)")
        return None
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
        raise ValueError(f"max_loras (--max-loras) must be a positive integer, got {max_loras!r}")
    if isinstance(max_lora_rank, bool) or not isinstance(max_lora_rank, int) \
            or not 1 <= max_lora_rank <= MAX_LORA_RANK_LIMIT:
        raise ValueError(f"max_lora_rank (--max-lora-rank) must be an integer in "
                         f"[1, {MAX_LORA_RANK_LIMIT}], got {max_lora_rank!r}")
    cpu = max_loras if max_cpu_loras is None else max_cpu_loras
    if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < max_loras:
        raise ValueError(f"max_cpu_loras (--max-cpu-loras) must be an integer >= max_loras "
                         f"({max_loras}), got {max_cpu_loras!r}")
    return LoRAConfig(max_loras, max_lora_rank, cpu, parse_lora_modules(lora_modules))
