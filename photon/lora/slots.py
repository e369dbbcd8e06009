"""LoRASlotPool: the scheduler's account of the device's adapter slots.

Slot 0 is the base model (zero weights, never handed out); slots 1..max_loras hold one adapter
each. A request takes a reference on its adapter's slot when it is admitted (its request index
is taken) and drops it when that index is released: for a finished, aborted or preempted request
only once its in-flight count reached zero (the zombie path that releases its KV blocks), so no
step in flight ever reads a slot that is being reloaded. A slot whose references reach zero keeps
its adapter (idle, found again by the next request for it) until a new adapter needs a slot:
then the least recently used idle one is reloaded. An adapter that finds no slot waits
(`SlotGate`: the requests behind it that can run go first).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from photon.core.step import LoRALoad
from photon.lora.request import LoRARequest

if TYPE_CHECKING:
    from photon.engine.request import Request


class LoRASlotPool:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: dict[int, int] = {}  # adapter id -> its slot
        self._adapter: list[int] = [0] * (max_loras + 1)  # slot -> adapter id (0: empty)
        self._refs = [0] * (max_loras + 1)
        self._idle: OrderedDict[int, None] = OrderedDict()  # loaded slots at 0 refs, LRU first
        self._empty = list(range(max_loras, 0, -1))  # never-loaded slots
        self.num_loads = 0

    @property
    def num_used(self) -> int:
        """Slots referenced by a request."""
        return sum(1 for r in self._refs[1:] if r > 0)

    def resident(self) -> dict[int, int]:
        """Adapter id -> slot, for every loaded slot."""
        return dict(self._slot_of)

    def refcount(self, slot: int) -> int:
        return self._refs[slot]

    def holds(self, lora_int_id: int) -> bool:
        """Whether the adapter is in a slot (referenced or idle)."""
        return lora_int_id in self._slot_of

    def can_acquire(self, lora: LoRARequest) -> bool:
        return lora.lora_int_id in self._slot_of or bool(self._empty or self._idle)

    def acquire(self, lora: LoRARequest) -> tuple[int, LoRALoad | None]:
        """A reference on the adapter's slot, and the load to plan when the adapter is not
        resident (callers check `can_acquire` first)."""
        slot = self._slot_of.get(lora.lora_int_id)
        load = None
        if slot is None:
            slot = self._empty.pop() if self._empty else self._evict()
            self._slot_of[lora.lora_int_id] = slot
            self._adapter[slot] = lora.lora_int_id
            load = LoRALoad(slot, lora.lora_int_id, lora.lora_name, lora.lora_path)
            self.num_loads += 1
        self._idle.pop(slot, None)
        self._refs[slot] += 1
        return slot, load

    def _evict(self) -> int:
        slot, _ = self._idle.popitem(last=False)
        del self._slot_of[self._adapter[slot]]
        self._adapter[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        assert self._refs[slot] > 0, f"LoRA slot {slot} released more often than taken"
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._idle[slot] = None

    def forget(self, lora_int_id: int) -> bool:
        """Drop an idle adapter from its slot (unload); False while a request references it."""
        slot = self._slot_of.get(lora_int_id)
        if slot is None:
            return True
        if self._refs[slot]:
            return False
        del self._idle[slot]
        del self._slot_of[lora_int_id]
        self._adapter[slot] = 0
        self._empty.append(slot)
        return True

    def check_invariants(self) -> None:
        """Assert internal consistency (used by tests)."""
        assert self._refs[0] == 0 and self._adapter[0] == 0
        for lora_id, slot in self._slot_of.items():
            assert self._adapter[slot] == lora_id
            assert (self._refs[slot] == 0) == (slot in self._idle)
        assert all(self._adapter[s] == 0 and self._refs[s] == 0 for s in self._empty)
        assert len(self._slot_of) + len(self._empty) == self.max_loras


class SlotGate:
    """One admission pass's LoRA check (the scheduler walks the waiting queue in order): whether
    a waiting request's adapter can have a slot now. A request refused here is skipped: it keeps
    its place in the queue and the requests behind it that can run are admitted (the base model,
    adapters in a slot, adapters that find one), as vLLM does.

    - Slots free only when a request is released (at commit, or a preemption before admission),
      never during an admission pass, and admitting only takes slots. So once one adapter that
      is not in a slot finds none, none does for the rest of the pass (`full`): later requests
      of such adapters are skipped without looking at the pool again.
    - The first request skipped for a slot in a pass (`first`) is the oldest one waiting for a
      slot. The pass goes in queue order, so when a slot frees, `first` is the first request to
      take it: no later request of another adapter not in a slot gets it before.
    - Requests of adapters already in a slot may overtake `first` (they need no new slot), but
      at most `limit` of them in all, counted on `first` across passes: past that they are
      skipped too, the slots drain as their running requests finish, and `first` gets one. Without
      the bound a steady stream of one resident adapter's requests would keep its slot
      referenced, and `first` would wait forever.
    """

    __slots__ = ("pool", "limit", "full", "first")

    def __init__(self, pool: LoRASlotPool, limit: int) -> None:
        self.pool = pool
        self.limit = limit
        self.full = False  # an adapter not in a slot found none: none will in this pass
        self.first: Request | None = None  # the first request skipped for a slot

    def admits(self, req: Request) -> bool:
        """Whether `req` (with an adapter) may be admitted now; False: skip it."""
        lora = req.lora_request
        if self.pool.holds(lora.lora_int_id):
            return self.first is None or self.first.lora_overtaken < self.limit
        if not self.full and self.pool.can_acquire(lora):
            return True
        self.full = True
        if self.first is None:
            self.first = req
        return False

    def admitted(self, req: Request) -> None:
        """`req` (with an adapter) was admitted: one more overtake of the oldest skipped one
        (if any); its own count starts again (it may wait again after a preemption)."""
        req.lora_overtaken = 0
        if self.first is not None:
            self.first.lora_overtaken += 1
