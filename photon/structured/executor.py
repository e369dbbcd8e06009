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
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from photon.structured.backend import GrammarBackend
from photon.structured.bitmask import TokenMask

_NONE = np.zeros(0, dtype=np.int64)


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
    """One step's grammar job: handle acc_handles[i] accepts acc_tokens[i] (a handle's several
    tokens in order: a speculative row's), then row fill_rows[i] of the mask is filled from handle
    fill_handles[i] (int64 arrays). A speculative row's entry i also has fill_drafts[i] drafts
    (the next ones of draft_tokens, in entry order; none if fill_drafts is empty): rows
    fill_rows[i] + 1 .. + fill_drafts[i] get the masks after each of them (see `run_job`)."""

    acc_handles: np.ndarray
    acc_tokens: np.ndarray
    fill_rows: np.ndarray
    fill_handles: np.ndarray
    fill_drafts: np.ndarray = field(default_factory=lambda: _NONE)
    draft_tokens: np.ndarray = field(default_factory=lambda: _NONE)

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
    accept their tokens, then fill their rows of `bits`. A matcher that rejected a token gets
    all-ones rows instead (its request aborts after the job). Returns the indices into the
    accepts that were rejected (a handle's first refusal; its later tokens are skipped)."""
    handles = job.acc_handles.tolist()
    rejected = _accept(backend, matchers, handles, job.acc_tokens.tolist())
    dead = {handles[i] for i in rejected}
    counts = job.fill_drafts.tolist() if job.fill_drafts.size else None
    drafts = job.draft_tokens.tolist()
    rows, fill, spec = [], [], []
    at = 0
    for i, (j, h) in enumerate(zip(job.fill_rows.tolist(), job.fill_handles.tolist())):
        n = counts[i] if counts is not None else 0
        if h in dead:
            bits[j:j + 1 + n] = -1
        else:
            rows.append(j)
            fill.append(matchers[h])
            if n:
                spec.append(_Drafted(matchers[h], j, drafts[at:at + n]))
        at += n
    if fill:
        backend.fill_bitmasks(fill, bits, rows)
    if spec:
        _fill_drafted(backend, spec, bits)
    return rejected


def _accept(backend: GrammarBackend, matchers: dict[int, Any], handles: list[int],
            tokens: list[int]) -> list[int]:
    """tokens[i] into matcher handles[i], a handle's tokens in order: one batch call per level
    (a matcher appears at most once in a call). Returns the indices refused; a matcher's tokens
    after its refusal are not offered."""
    pending, rejected, dead = list(range(len(handles))), [], set()
    while pending:
        level, rest, seen = [], [], set()
        for i in pending:
            h = handles[i]
            if h in dead:
                continue
            (rest if h in seen else level).append(i)
            seen.add(h)
        ok = backend.accept_tokens([matchers[handles[i]] for i in level],
                                   [tokens[i] for i in level])
        for i, accepted in zip(level, ok):
            if not accepted:
                rejected.append(i)
                dead.add(handles[i])
        pending = rest
    return rejected


@dataclass
class _Drafted:
    """A speculative row's matcher while its draft positions are filled."""

    matcher: Any
    row: int  # the mask row of the row's first position
    drafts: list[int]
    taken: int = 0  # drafts accepted into the matcher (rolled back at the end)


def _fill_drafted(backend: GrammarBackend, spec: list[_Drafted], bits: torch.Tensor) -> None:
    """Rows row + 1 + l: the masks after drafts 0..l, level by level (one batch accept and fill
    each). A draft the grammar refuses, or one that ends it, leaves the rows after it all-ones:
    the verification rejects a refused draft at its own position (the target's masked
    probability is 0), and after an accepted stop token nothing is committed, so no token
    sampled there is ever emitted. Then every matcher rolls back what it took."""
    active, level = spec, 0
    try:
        while active:
            ok = backend.accept_tokens([d.matcher for d in active],
                                       [d.drafts[level] for d in active])
            go = []
            for d, accepted in zip(active, ok):
                d.taken += int(accepted)
                if accepted and not d.matcher.is_terminated():
                    go.append(d)
                else:
                    bits[d.row + level + 1:d.row + 1 + len(d.drafts)] = -1
            if go:
                backend.fill_bitmasks([d.matcher for d in go], bits,
                                      [d.row + level + 1 for d in go])
            level += 1
            active = [d for d in go if len(d.drafts) > level]
    finally:  # the matchers hold committed tokens only, also when a fill failed
        for d in spec:
            if d.taken:
                d.matcher.rollback(d.taken)
