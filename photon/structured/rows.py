"""GrammarRowPool: one step's per-row matcher work (accept at commit, bitmask fill at finalize)
split across threads.

Why: an xgrammar JSON-schema `accept` costs about 28 us per token and a fill about 6 us on the CI
CPU, so 128 grammar rows serially add ~4 ms of host time to every step, longer than the forward it
should hide behind. The backend's calls release the GIL and each row's matcher is independent, so
contiguous chunks of rows run in parallel. The calling thread runs the first chunk itself; small
batches (under two chunks' worth) stay on the calling thread and pay no dispatch.

Invariant: `run` returns only after every row's call has finished (or re-raises the first error),
so commit and finalize keep their order: no matcher is touched outside its stage.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

MIN_ROWS_PER_CHUNK = 8


def default_threads() -> int:
    """Half the cores (the engine thread and the server's event loop keep the rest), at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _run_range(fn: Callable[[int], None], lo: int, hi: int) -> None:
    for i in range(lo, hi):
        fn(i)


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
        chunks = min(self.threads, n // self.min_rows_per_chunk)
        if chunks <= 1 or self._pool is None:
            _run_range(fn, 0, n)
            return
        bounds = [n * c // chunks for c in range(chunks + 1)]
        futures = [self._pool.submit(_run_range, fn, bounds[c], bounds[c + 1])
                   for c in range(1, chunks)]
        try:
            _run_range(fn, bounds[0], bounds[1])
        finally:
            for f in futures:
                f.result()

    def map(self, fn: Callable[[int], bool], n: int) -> list[bool]:
        """[fn(i) for i in range(n)], computed like `run`."""
        out = [False] * n

        def one(i: int) -> None:
            out[i] = fn(i)

        self.run(one, n)
        return out

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
