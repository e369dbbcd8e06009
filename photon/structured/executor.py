"""Where grammar matchers live and a step's accepts and mask fill run.

A step's grammar work is one job: the matchers accept step t's committed tokens, then fill the
masks of step t+1's rows. The engine `submit`s it right after commit(t)'s wait, appends tokens,
checks stops and plans t+2; sample(t+1) then either makes the GPU wait for the job's
`device_fence` (the grammar worker on CUDA: the engine thread does not wait at all) or `wait`s for
it on the host. The job's result (rejected tokens) is collected with `wait` by commit(t+1) at the
latest.

- `InlineExecutor` runs the job at `submit`, on the engine thread (no overlap).
- `ProcessExecutor` (photon.structured.worker) runs it in a grammar-worker process, beside the
  engine thread's Python: the fill (xgrammar's C++) leaves the engine's critical path. A thread
  in the engine process would not: it needs the GIL to start and finish each call, so its
  hand-offs contend with the engine thread's Python.

Matchers are addressed by handle (`open` returns one per sequence; `close` frees it): a small
integer, reused once closed, that indexes the executor's matcher table (the engine keeps it in a
per-pool-row column: photon.structured.rows). A step's rows go in as int64 arrays. Masks are written into host buffers the
executor hands out (`mask_buffer`): pinned memory inline, shared memory registered with CUDA for the
worker, so either way the H2D copy is asynchronous.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from photon.structured.backend import GrammarBackend
from photon.structured.bitmask import TokenMask


class GrammarExecutor(Protocol):
    def prepare(self, key: tuple, spec: Any) -> None:
        """A grammar is being compiled on the engine side (the worker compiles its own copy)."""

    def forget(self, key: tuple) -> None:
        """The engine's compile cache dropped `key`."""

    def ready(self) -> bool:
        """Whether matchers can be opened (a worker may still be starting)."""

    def open(self, key: tuple, compiled: Any) -> int:
        """A matcher at the start of a compiled grammar; returns its handle."""

    def close(self, handle: int) -> None:
        """The matcher's sequence is released: no job refers to it any more."""

    @property
    def open_matchers(self) -> int:
        """Matchers opened and not closed (0 after a drain)."""

    def mask_buffer(self, index: int, numel: int) -> torch.Tensor:
        """Host int32 buffer `index` (one per pipeline slot), at least `numel` long."""

    def submit(self, job: StepJob, mask: TokenMask | None, index: int) -> None:
        """Run `job`, filling `mask.bits` (a view of `mask_buffer(index)`): see `run_job`."""

    def device_fence(self, index: int) -> tuple[int, int] | None:
        """(host address, value): a page-locked int32 word that reaches the value once the job
        last submitted for mask buffer `index` is done (the GPU can wait on it instead of the
        engine thread: photon.worker.stream_wait). None where only `wait` can tell."""

    def wait(self) -> list[int]:
        """Until the submitted job is done; the indices into its `accepts` that were rejected."""

    @property
    def clock(self) -> JobClock:
        """Time spent in step jobs (wherever they ran)."""

    def shutdown(self) -> None:
        """Stop the executor's workers (idempotent)."""


@dataclass
class StepJob:
    """One step's grammar job: handle acc_handles[i] accepts acc_tokens[i], then row
    fill_rows[i] of the mask is filled from handle fill_handles[i] (int64 arrays)."""

    acc_handles: np.ndarray
    acc_tokens: np.ndarray
    fill_rows: np.ndarray
    fill_handles: np.ndarray

    @property
    def empty(self) -> bool:
        return not (self.acc_handles.size or self.fill_rows.size)


class Handles:
    """Matcher handles: small integers, reused once closed."""

    def __init__(self) -> None:
        self._next = 0
        self._free: list[int] = []

    def take(self) -> int:
        if self._free:
            return self._free.pop()
        self._next += 1
        return self._next - 1

    def give(self, handle: int) -> None:
        self._free.append(handle)

    @property
    def in_use(self) -> int:
        return self._next - len(self._free)


class JobClock:
    """Time in step jobs: the total, and the latest jobs one by one (bench structured reports
    their median and tail: a few dear rows make a slow step)."""

    def __init__(self, keep: int = 4096) -> None:
        self.total_s = 0.0
        self.recent: deque[float] = deque(maxlen=keep)

    def add(self, seconds: float) -> None:
        self.total_s += seconds
        self.recent.append(seconds)


class InlineExecutor:
    """The job runs on the caller's thread, inside `submit`."""

    def __init__(self, backend: GrammarBackend, pin: bool) -> None:
        self.backend = backend
        self.pin = pin
        self._buffers: dict[int, torch.Tensor] = {}
        self._matchers: dict[int, Any] = {}
        self._handles = Handles()
        self._rejected: list[int] = []
        self.clock = JobClock()

    def prepare(self, key: tuple, spec: Any) -> None:
        pass

    def forget(self, key: tuple) -> None:
        pass

    def ready(self) -> bool:
        return True

    def open(self, key: tuple, compiled: Any) -> int:
        handle = self._handles.take()
        self._matchers[handle] = self.backend.matcher(compiled)
        return handle

    def close(self, handle: int) -> None:
        del self._matchers[handle]
        self._handles.give(handle)

    @property
    def open_matchers(self) -> int:
        return self._handles.in_use

    def mask_buffer(self, index: int, numel: int) -> torch.Tensor:
        buf = self._buffers.get(index)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[index] = torch.zeros(numel, dtype=torch.int32, pin_memory=self.pin)
        return buf

    def submit(self, job: StepJob, mask: TokenMask | None, index: int) -> None:
        start = time.perf_counter()
        self._rejected = run_job(self.backend, self._matchers, job,
                                 mask.bits if mask is not None else None)
        self.clock.add(time.perf_counter() - start)

    def device_fence(self, index: int) -> tuple[int, int] | None:
        return None  # the job ran in submit

    def wait(self) -> list[int]:
        rejected, self._rejected = self._rejected, []
        return rejected

    def shutdown(self) -> None:
        pass


def run_job(backend: GrammarBackend, matchers: dict[int, Any], job: StepJob,
            bits: torch.Tensor | None) -> list[int]:
    """One step's grammar job, wherever it runs (engine thread or grammar worker): the matchers
    accept their tokens, then fill their rows of `bits`. A matcher that rejected its token gets
    an all-ones row instead (its request aborts after the job). Returns the indices into the
    accepts that were rejected."""
    acc = [matchers[h] for h in job.acc_handles.tolist()]
    ok = backend.accept_tokens(acc, job.acc_tokens.tolist()) if acc else []
    rejected = [i for i, accepted in enumerate(ok) if not accepted]
    dead = {id(acc[i]) for i in rejected}
    rows, fill = [], []
    for j, h in zip(job.fill_rows.tolist(), job.fill_handles.tolist()):
        matcher = matchers[h]
        if id(matcher) in dead:
            bits[j] = -1
        else:
            rows.append(j)
            fill.append(matcher)
    if fill:
        backend.fill_bitmasks(fill, bits, rows)
    return rejected
