"""GrammarRowPool: one step's grammar-mask fills (finalize) split across threads. Accepts (commit)
stay on the engine thread: at 2-4 us each, dispatch would cost more than it saves.

Why: with a ~120k-token vocabulary an xgrammar (0.2.9) mask fill costs 5-7 us in structural JSON
states but 160-330 us inside a string and 300-900 us inside a number with a range (minimum /
maximum), measured on the CI CPU; 128 grammar rows serially can add tens of ms to every step,
far longer than the forward they should hide behind. The backend's calls release the GIL and
each row's matcher is independent, so rows run in parallel: the workers and the calling thread
take the next row from a shared counter (costs differ 100x between rows, so fixed chunks would
leave threads idle). Small batches (under two chunks' worth) stay on the calling thread.

Invariant: `run` returns only after every row's call has finished (or re-raises the first error),
so no matcher is touched outside finalize.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

MIN_ROWS_PER_CHUNK = 8


def default_threads() -> int:
    """All cores but two (the server's event loop and the tokenizer keep those), at most 16: the
    engine thread waits for the fill anyway, and one JSON fill can take ~1 ms (see below)."""
    return max(1, min(16, (os.cpu_count() or 2) - 2))


def _drain(fn: Callable[[int], None], rows: Iterator[int], n: int) -> None:
    """Run fn on rows taken from the shared counter until it passes n (`next` is atomic)."""
    i = next(rows)
    while i < n:
        fn(i)
        i = next(rows)


class GrammarRowPool:
    def __init__(self, threads: int, min_rows_per_chunk: int = MIN_ROWS_PER_CHUNK) -> None:
        if threads < 1:
            raise ValueError(f"grammar row threads must be >= 1, got {threads}")
        self.threads = threads
        self.min_rows_per_chunk = max(1, min_rows_per_chunk)
        self._pool = (ThreadPoolExecutor(threads - 1, thread_name_prefix="photon-grammar-rows")
                      if threads > 1 else None)

    def run(self, fn: Callable[[int], None], n: int) -> None:
        """fn(i) for every i in range(n); rows are independent, so the order among them is free."""
        workers = min(self.threads, n // self.min_rows_per_chunk)
        if workers <= 1 or self._pool is None:
            for i in range(n):
                fn(i)
            return
        rows = itertools.count()
        futures = [self._pool.submit(_drain, fn, rows, n) for _ in range(workers - 1)]
        try:
            _drain(fn, rows, n)
        finally:
            for f in futures:
                f.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
