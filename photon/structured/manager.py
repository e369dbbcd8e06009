"""StructuredOutputManager: compiles grammars off the engine thread, caches them by spec, and
hands each sequence its own matcher once its grammar is ready.

- `compile(spec)` returns a `concurrent.futures.Future` shared by every request with an equal spec
  (the cache holds futures, so a second request for a grammar still compiling waits for the same
  compile). It is thread-safe: the server awaits it on the event loop to answer 400 early.
- `RequestGrammar` is the per-sequence state the scheduler sees: `poll()` says whether the grammar
  is ready, failed (with the message) or still compiling; after that the matcher advances at
  commit and fills the next-token bitmask at finalize.
- A compile that outlives `timeout_s` (measured from the request's arrival) fails that request
  with a GrammarError; the thread keeps running and its result may still serve later requests.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from photon.structured.backend import GrammarBackend, GrammarError, GrammarMatcher, create_backend
from photon.structured.params import StructuredOutputsParams
from photon.tokenizer import Tokenizer

CACHE_ENTRIES = 1024


class StructuredOutputManager:
    def __init__(self, backend: str, tokenizer: Tokenizer, vocab_size: int, timeout_s: float,
                 max_workers: int = 2, fill_threads: int = 1) -> None:
        self.backend_name = backend
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="photon-grammar")
        # The backend's threads for a step's mask fills (the model runner's finalize).
        self.fill_threads = fill_threads

    @property
    def backend(self) -> GrammarBackend:
        """Created on first use (building the backend's vocabulary tables takes a moment)."""
        with self._lock:
            if self._backend is None:
                self._backend = create_backend(self.backend_name, self.tokenizer, self.vocab_size,
                                               self.fill_threads)
            return self._backend

    def compile(self, spec: StructuredOutputsParams) -> Future:
        key = spec.key()
        backend = self.backend
        with self._lock:
            fut = self._cache.get(key)
            if fut is None or fut.cancelled():
                fut = self._pool.submit(backend.compile, spec)
                self._cache[key] = fut
                if len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            return fut

    def request_grammar(self, spec: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(self, self.compile(spec), time.monotonic() + self.timeout_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One sequence's grammar: compiling, then a matcher over its committed output tokens."""

    def __init__(self, manager: StructuredOutputManager, future: Future, deadline: float) -> None:
        self.manager = manager
        self.future = future
        self.deadline = deadline
        self.matcher: GrammarMatcher | None = None
        self.num_accepted = 0  # tokens the matcher has accepted (the fill checks it)
        self.terminated = False  # as of the last accept: read without touching the matcher
        self.rejected = False  # the matcher refused a committed token (an engine bug)

    def poll(self) -> bool:
        """True once the matcher is ready; False while compiling; raises GrammarError."""
        if self.matcher is not None:
            return True
        if not self.future.done():
            if time.monotonic() >= self.deadline:
                raise GrammarError(f"grammar compilation timed out after "
                                   f"{self.manager.timeout_s:g} s (structured_outputs_timeout)")
            return False
        if self.future.cancelled():
            raise GrammarError("grammar compilation was cancelled (the engine is shutting down)")
        exc = self.future.exception()
        if exc is not None:
            raise exc if isinstance(exc, GrammarError) else GrammarError(str(exc))
        self.matcher = self.manager.backend.matcher(self.future.result())
        return True

    def is_terminated(self) -> bool:
        """Complete and its stop token accepted: no more tokens (commit and the mask fill both
        ask every step, so it is cached at accept)."""
        return self.terminated


def accept_tokens(grammars: list[RequestGrammar], tokens: list[int]) -> None:
    """Advance each grammar's matcher by its committed token, in one backend call. A matcher
    accepts a stop token only where its grammar may end and is terminated exactly then, so
    `terminated` needs no call per matcher. A rejection sets `rejected` (the matcher stays put)."""
    assert all(g.matcher is not None for g in grammars), \
        "a token was committed before the grammar was ready"
    backend = grammars[0].manager.backend
    ok = backend.accept_tokens([g.matcher for g in grammars], tokens)
    stops = backend.stop_token_ids
    for grammar, token_id, accepted in zip(grammars, tokens, ok):
        if accepted:
            grammar.num_accepted += 1
            grammar.terminated = token_id in stops
        else:
            grammar.rejected = True
