"""LoRASlotPool: references, LRU eviction of idle adapters, waiting when every slot is in use."""

from __future__ import annotations

from photon.lora.request import LoRARequest
from photon.lora.slots import LoRASlotPool


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}")


def test_refcounts_lru_eviction_and_waiting() -> None:
    pool = LoRASlotPool(2)
    s1, load1 = pool.acquire(lora(1))
    s1b, again = pool.acquire(lora(1))
    assert (s1b, again) == (s1, None) and pool.refcount(s1) == 2  # resident: no second load
    s2, load2 = pool.acquire(lora(2))
    assert {s1, s2} == {1, 2} and load1.slot == s1 and load2.lora_int_id == 2
    assert not pool.can_acquire(lora(3))  # both slots referenced: adapter 3 waits
    pool.release(s1)
    assert not pool.can_acquire(lora(3))  # still one reference on adapter 1
    pool.release(s1)
    pool.release(s2)  # adapter 2 is idle more recently than adapter 1
    s3, load3 = pool.acquire(lora(3))
    assert s3 == s1 and load3.slot == s1  # the least recently used idle slot is reloaded
    assert pool.resident() == {2: s2, 3: s3}
    assert pool.forget(2) and not pool.forget(3)  # 3 is in use
    pool.release(s3)
    pool.check_invariants()
    assert pool.num_used == 0
