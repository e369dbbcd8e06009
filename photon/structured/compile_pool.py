"""CompilePool: grammar compiles on daemon threads, with a lane that keeps small grammars served.

A running compile cannot be interrupted (xgrammar's C++ does not poll for cancellation), so the
pool bounds what a slow one can block instead:
- At most `slots` compiles run at once. A heavy one (a spec longer than `HEAVY_CHARS`) may use at
  most `slots - 1` of them, so a small grammar always finds a free slot however many heavy ones
  are queued.
- `abandon` (the compile's time ran out) fails its future at once and frees its slot; the thread
  finishes in the background and its result is dropped (never cached). While abandoned compiles
  still run they count against the heavy lane, so a stream of slow grammars cannot pile up
  threads; small compiles are not held back by them.
- Threads are daemons and `shutdown` waits for none of them: a compile never holds up engine
  shutdown or interpreter exit.
A queued job runs in submission order among those its lane lets start.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

HEAVY_CHARS = 4096  # a spec's text length from which its compile goes to the heavy lane
COMPILE_SLOTS = 3  # concurrent compiles per process (engine, grammar worker)


def is_heavy(key: tuple) -> bool:
    """Whether the compile of a spec with this cache key (StructuredOutputsParams.key) goes to
    the heavy lane."""
    return len(key[1]) > HEAVY_CHARS


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    ABANDONED = "abandoned"  # still running; its result is dropped
    DONE = "done"


@dataclass(frozen=True)
class PoolCounts:
    """Jobs by state: what the lanes decide from."""

    queued: int
    running: int
    abandoned: int


@dataclass(eq=False)
class _Job:
    fn: Callable[[], Any]
    heavy: bool
    future: Future = field(default_factory=Future)
    state: _State = _State.QUEUED


class CompilePool:
    def __init__(self, slots: int, name: str = "photon-grammar") -> None:
        if slots < 2:
            raise ValueError(f"a compile pool needs at least 2 slots (one kept for small "
                             f"grammars), got {slots}")
        self.slots = slots
        self.name = name
        self._lock = threading.Lock()
        self._queue: list[_Job] = []
        self._jobs: dict[int, _Job] = {}  # id(future) -> job, until its thread returns
        self._closed = False

    def submit(self, fn: Callable[[], Any], heavy: bool) -> Future:
        """Run `fn()` when a slot of its lane is free; a future of its result."""
        job = _Job(fn, heavy)
        with self._lock:
            if self._closed:
                job.future.cancel()
                return job.future
            self._jobs[id(job.future)] = job
            self._queue.append(job)
            self._start_ready()
        return job.future

    def abandon(self, future: Future, error: BaseException) -> bool:
        """Fail `future` with `error` unless it is done (then False); a queued job never runs,
        a running one frees its slot and its result is dropped."""
        with self._lock:
            job = self._jobs.get(id(future))
            if job is None or job.state not in (_State.QUEUED, _State.RUNNING):
                return False
            if job.state is _State.QUEUED:
                self._queue.remove(job)
                del self._jobs[id(future)]
                job.state = _State.DONE
            else:
                job.state = _State.ABANDONED
            self._start_ready()
        future.set_exception(error)
        return True

    def shutdown(self) -> None:
        """Cancel every job that is queued or running; wait for no thread (idempotent)."""
        with self._lock:
            self._closed = True
            jobs = [j for j in self._jobs.values() if j.state in (_State.QUEUED, _State.RUNNING)]
            for job in jobs:
                job.state = _State.ABANDONED if job.state is _State.RUNNING else _State.DONE
            self._queue.clear()
        for job in jobs:
            job.future.cancel()

    def counts(self) -> PoolCounts:
        with self._lock:
            states = [j.state for j in self._jobs.values()]
        return PoolCounts(states.count(_State.QUEUED), states.count(_State.RUNNING),
                          states.count(_State.ABANDONED))

    def _can_start(self, job: _Job, running: int, heavy_busy: int) -> bool:
        if running >= self.slots:
            return False
        return not job.heavy or heavy_busy < self.slots - 1

    def _start_ready(self) -> None:
        """Start every queued job its lane admits (caller holds the lock)."""
        if self._closed:
            return
        jobs = self._jobs.values()
        running = sum(j.state is _State.RUNNING for j in jobs)
        heavy_busy = sum((j.state is _State.RUNNING and j.heavy) or j.state is _State.ABANDONED
                         for j in jobs)
        for job in list(self._queue):
            if not self._can_start(job, running, heavy_busy):
                continue
            self._queue.remove(job)
            job.state = _State.RUNNING
            running += 1
            heavy_busy += job.heavy
            threading.Thread(target=self._run, args=(job,), name=self.name, daemon=True).start()

    def _run(self, job: _Job) -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = job.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the future's waiters
            error = e
        with self._lock:
            deliver = job.state is _State.RUNNING
            job.state = _State.DONE
            self._jobs.pop(id(job.future), None)
            self._start_ready()
        if not deliver:  # abandoned or cancelled: nobody may see this result
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)
