"""GrammarRowPool: per-row work shared by threads, every row once, errors re-raised, small
batches kept on the calling thread."""

from __future__ import annotations

import threading
import time

import pytest

from photon.structured.rows import GrammarRowPool


@pytest.mark.parametrize("threads,n", [(1, 50), (3, 0), (3, 5), (3, 16), (4, 37), (8, 100)])
def test_run_covers_every_row_once(threads: int, n: int) -> None:
    pool = GrammarRowPool(threads, min_rows_per_chunk=4)
    calls: list[int] = []
    lock = threading.Lock()

    def fn(i: int) -> None:
        with lock:
            calls.append(i)

    pool.run(fn, n)
    assert sorted(calls) == list(range(n))
    pool.shutdown()


def test_rows_spread_over_threads_only_when_large() -> None:
    pool = GrammarRowPool(4, min_rows_per_chunk=8)
    seen: dict[int, set[str]] = {}

    def fn(i: int) -> None:
        seen.setdefault(i, set()).add(threading.current_thread().name)
        time.sleep(0.002)  # long enough that the workers take rows too

    pool.run(fn, 15)  # under two chunks' worth: the calling thread only
    assert {n for s in seen.values() for n in s} == {threading.current_thread().name}
    seen.clear()
    pool.run(fn, 64)  # the caller and three workers share the rows
    names = {n for s in seen.values() for n in s}
    assert threading.current_thread().name in names
    assert len(names) >= 2 and all(len(s) == 1 for s in seen.values())
    pool.shutdown()


def test_error_in_a_worker_chunk_is_raised_after_all_rows_ran() -> None:
    pool = GrammarRowPool(2, min_rows_per_chunk=2)
    done: list[int] = []

    def fn(i: int) -> None:
        if i == 9:
            raise RuntimeError("row 9 failed")
        done.append(i)

    with pytest.raises(RuntimeError, match="row 9"):
        pool.run(fn, 10)
    assert sorted(done) == list(range(9))
    pool.shutdown()


def test_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        GrammarRowPool(0)
