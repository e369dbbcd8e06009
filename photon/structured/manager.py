"""StructuredOutputManager: compiles grammars off the engine thread, caches them by spec, and
hands each sequence its own matcher once its grammar is ready.

- `compile(spec)` checks the spec against the size limits (`GrammarLimits`), then returns a
  `concurrent.futures.Future` shared by every request with an equal spec (the cache holds
  futures, so a second request for a grammar still compiling waits for the same compile). It is
  thread-safe: the server awaits it on the event loop to answer 400 early. Compiles run on a
  `CompilePool` (a small grammar is never queued behind heavy ones); the cache is bounded in
  bytes (photon.structured.grammar_cache) and the grammar worker keeps exactly the engine's
  cached grammars plus those its open matchers use.
- `RequestGrammar` is the per-sequence state the scheduler sees: `poll()` says whether the grammar
  is ready, failed (with the message) or still compiling; after that its matcher (a handle into
  the executor: photon.structured.executor) accepts the committed tokens and fills the next-token
  masks, one job per step (`submit` after commit(t)'s wait, `wait` by commit(t+1)); which rows
  a job touches is photon.structured.rows' business.
- A compile that outlives `timeout_s` (measured from the request's arrival) is expired: it fails
  every request waiting for it with a GrammarError, frees its compile slot and leaves the cache
  (here and in the grammar worker); its thread's result is dropped.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future
from functools import partial

from photon.config import StructuredOutputsConfig
from photon.structured.backend import GrammarBackend, GrammarError, create_backend
from photon.structured.bitmask import TokenMask
from photon.structured.compile_pool import COMPILE_SLOTS, CompilePool, is_heavy
from photon.structured.executor import GrammarExecutor, InlineExecutor, StepJob
from photon.structured.grammar_cache import GrammarCache
from photon.structured.params import StructuredOutputsParams
from photon.tokenizer import Tokenizer


class StructuredOutputManager:
    def __init__(self, config: StructuredOutputsConfig, tokenizer: Tokenizer, vocab_size: int,
                 max_rows: int, cuda: bool) -> None:
        """`config`: every setting (backend, timeout, fill threads, worker, limits, cache size);
        `max_rows`: most grammar rows in one step; `cuda`: masks go to a CUDA device."""
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend: GrammarBackend | None = None
        self._executor: GrammarExecutor | None = None
        # Reentrant: a compile that finishes at once runs its done-callback inside compile().
        self._lock = threading.RLock()
        self._cache = GrammarCache(config.cache_bytes)
        self._pool = CompilePool(COMPILE_SLOTS)
        self.max_rows, self.cuda = max_rows, cuda
        self._in_flight = False  # a job was submitted and not waited for
        self._closing: list[int] = []  # released while a job was in flight: closed after it

    @property
    def backend(self) -> GrammarBackend:
        """Created on first use (building the backend's vocabulary tables takes a moment)."""
        if self._backend is not None:  # set once, never replaced: no lock on the step path
            return self._backend
        with self._lock:
            return self._backend_locked()

    def _backend_locked(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = create_backend(self.config.backend, self.tokenizer, self.vocab_size,
                                           self.config.threads)
        return self._backend

    @property
    def started(self) -> bool:
        """Whether the executor exists (it is created with the first grammar)."""
        return self._executor is not None

    @property
    def executor(self) -> GrammarExecutor:
        """Created with the first grammar (a worker process starts then: seconds)."""
        if self._executor is not None:
            return self._executor
        with self._lock:
            return self._executor_locked()

    def _executor_locked(self) -> GrammarExecutor:
        if self._executor is None:
            backend = self._backend_locked()
            if self.config.worker == "inline":
                self._executor = InlineExecutor(backend, pin=self.cuda)
            else:
                from photon.structured.worker import ProcessExecutor

                self._executor = ProcessExecutor(
                    self.tokenizer, self.config.backend, self.vocab_size, self.config.threads,
                    self.max_rows, backend.mask_words, self.cuda)
        return self._executor

    def start(self, wait_s: float = 0.0) -> bool:
        """Start the executor now (the grammar worker boots in the background) instead of with
        the first grammar; wait up to `wait_s` seconds for it; whether it is ready."""
        executor = self.executor
        deadline = time.monotonic() + wait_s
        while not executor.ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        return executor.ready()

    def compile(self, spec: StructuredOutputsParams, pin: bool = False) -> Future:
        """The compile of `spec` (raises ValueError past a size limit); `pin`: the caller will
        open a matcher on it (see `unpin`)."""
        self.config.limits.check(spec)
        key = spec.key()
        with self._lock:
            backend, executor = self._backend_locked(), self._executor_locked()
            fut = self._cache.get(key)
            if fut is None or fut.cancelled():
                fut = self._pool.submit(partial(backend.compile, spec), is_heavy(key))
                executor.prepare(key, spec)
                self._forget(self._cache.put(key, fut))
                # weak: the cache holds the future, so a strong callback would be a cycle that
                # keeps a dropped engine's grammar worker running until a garbage collection
                fut.add_done_callback(partial(_compiled, weakref.ref(self), key))
            if pin:
                self._cache.pin(key, fut)
            return fut

    def compiled(self, key: tuple, fut: Future) -> None:
        """`fut` (the compile of `key`) is done: its cache entry takes the grammar's size."""
        ok = not fut.cancelled() and fut.exception() is None
        nbytes = self.backend.memory_bytes(fut.result()) if ok else 0
        with self._lock:
            self._forget(self._cache.compiled(key, fut, nbytes))

    def _forget(self, keys: list[tuple]) -> None:
        for key in keys:
            try:
                self.executor.forget(key)
            except RuntimeError:
                pass  # the grammar worker is gone, and its grammars with it

    def unpin(self, key: tuple, fut: Future) -> None:
        """A request pinned on `compile` opened its matcher or ended: its entry may be evicted."""
        with self._lock:
            self._forget(self._cache.unpin(key, fut))

    def expire(self, key: tuple, fut: Future) -> None:
        """A compile ran out of time: every request waiting for it fails, its slot is freed and
        it leaves the cache (here and in the grammar worker)."""
        with self._lock:  # a compile that just finished stays: its requests open matchers
            if self._pool.abandon(fut, GrammarError(self.timeout_message)):
                self._forget(self._cache.pop(key, fut))

    @property
    def timeout_message(self) -> str:
        return (f"grammar compilation timed out after {self.config.timeout_s:g} s "
                f"(structured_outputs_timeout)")

    @property
    def cache(self) -> GrammarCache:
        """Compiled grammars by spec key (read it under no other lock: tests and stats)."""
        return self._cache

    @property
    def pool(self) -> CompilePool:
        return self._pool

    def request_grammar(self, spec: StructuredOutputsParams, start_after: int | None = None
                        ) -> RequestGrammar:
        return RequestGrammar(self, spec.key(), self.compile(spec, pin=True),
                              time.monotonic() + self.config.timeout_s, start_after)

    def submit(self, job: StepJob, mask: TokenMask | None, index: int = 0) -> None:
        """One step's job: the accepts (step t's committed tokens), then the fills of step t+1's
        grammar rows into `mask` (the other rows were set by `GrammarRows.fill`), a view of the
        executor's mask buffer `index`."""
        self.executor.submit(job, mask, index)
        self._in_flight = True

    @property
    def in_flight(self) -> bool:
        """Whether a submitted job was not waited for yet."""
        return self._in_flight

    def wait(self) -> list[int]:
        """Until the submitted job is done; the indices into its accepts that rejected their
        token."""
        self._in_flight = False
        try:
            return self.executor.wait()
        finally:
            self._close_pending()

    def close(self, handle: int) -> None:
        """A sequence is done with its matcher. While a job is in flight the handle is closed
        only after it: that job may still accept the sequence's last token (a request can be
        released in the commit that submitted it), so the handle must not be reused by another
        sequence before then."""
        self._closing.append(handle)
        if not self._in_flight:
            self._close_pending()

    def _close_pending(self) -> None:
        for handle in self._closing:
            try:
                self.executor.close(handle)
            except RuntimeError:
                pass  # the grammar worker is gone, and its matchers with it
        self._closing = []

    def shutdown(self) -> None:
        """Cancel queued and running compiles without waiting for them, then stop the worker."""
        self._pool.shutdown()
        if self._executor is not None:
            self._executor.shutdown()


def _compiled(manager: weakref.ref[StructuredOutputManager], key: tuple, fut: Future) -> None:
    alive = manager()
    if alive is not None:
        alive.compiled(key, fut)


class RequestGrammar:
    """One sequence's grammar: compiling, then a matcher over its committed output tokens."""

    def __init__(self, manager: StructuredOutputManager, key: tuple, future: Future,
                 deadline: float, start_after: int | None = None) -> None:
        self.manager = manager
        self.key = key
        self.future = future
        self.deadline = deadline
        self.handle: int | None = None  # the executor's matcher handle, once compiled
        # Reasoning gate: the grammar starts after this token (the end of the reasoning) is
        # committed; until then masks allow all and the matcher sees nothing. None: no gate.
        self.start_after = start_after
        # Whether start_after was committed (or there is none): the scheduler's view, updated at
        # commit; a request speculates only once its gate passed.
        self.gate_passed = start_after is None
        self._pinned = True  # its cache entry stays until its matcher is open (or it ends)

    def poll(self) -> bool:
        """True once the matcher is ready; False while compiling (or while the grammar worker
        starts); raises GrammarError."""
        if self.handle is not None:
            return True
        if not self.future.done():
            if time.monotonic() < self.deadline:
                return False
            self.manager.expire(self.key, self.future)
        if self.future.cancelled():
            raise GrammarError("grammar compilation was cancelled (the engine is shutting down)")
        exc = self.future.exception()
        if exc is not None:
            raise exc if isinstance(exc, GrammarError) else GrammarError(str(exc))
        try:
            executor = self.manager.executor
            if not executor.ready():
                return False
            self.handle = executor.open(self.key, self.future.result())
        except RuntimeError as e:  # the grammar worker is gone: this request fails, not the engine
            raise GrammarError(f"structured outputs are unavailable: {e}") from None
        self._unpin()
        return True

    def _unpin(self) -> None:
        if self._pinned:
            self._pinned = False
            self.manager.unpin(self.key, self.future)

    def release(self) -> None:
        """The sequence is done: no step in flight samples for it any more."""
        self._unpin()
        if self.handle is not None:
            self.manager.close(self.handle)
            self.handle = None
