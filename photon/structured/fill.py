"""Where a step's grammar-mask fill runs: inline on the engine thread, or on a fill thread that
overlaps the engine thread's commit and planning (the pipelined loop starts the fill of t+1 as
soon as the matchers hold token t, and finalize(t+1) waits for it).

The fill itself is one backend call that releases the GIL (xgrammar's C++), so a thread can run it
beside the engine thread's Python. A thread needs the GIL to start and to finish, though, and a
thread waiting for the GIL while another runs Python waits out the interpreter's switch interval
(5 ms): the cause of the earlier thread attempts' slow steps. So the hand-off is explicit: `start`
blocks (the GIL free) until the fill thread is about to enter the backend call, and the fill thread
finishes only while `wait` blocks. Each costs a thread wake-up, not a switch interval.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class InlineFill:
    """Runs the fill at `start`, on the caller's thread."""

    def __init__(self) -> None:
        self.busy_s = 0.0  # time inside fills (bench structured reports it)

    def start(self, fill: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        fill()
        self.busy_s += time.perf_counter() - t0

    def wait(self) -> None:
        pass


class FillThread:
    """One daemon thread; `start` then `wait`, strictly alternating, from one caller thread."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self._fill: Callable[[], None] | None = None
        self._error: BaseException | None = None
        self._go = threading.Semaphore(0)
        self._entered = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._pending = False
        threading.Thread(target=self._run, name="photon-mask-fill", daemon=True).start()

    def start(self, fill: Callable[[], None]) -> None:
        assert not self._pending, "start() twice without wait()"
        self._fill, self._pending = fill, True
        self._go.release()
        self._entered.acquire()  # blocks with the GIL released until the thread is in the call

    def wait(self) -> None:
        """Until the fill is done; re-raises its error."""
        if not self._pending:
            return
        self._done.acquire()
        self._pending = False
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            self._go.acquire()
            fill = self._fill
            t0 = time.perf_counter()
            self._entered.release()
            try:
                fill()
            except BaseException as e:  # noqa: BLE001 - handed to the engine thread by wait()
                self._error = e
            self.busy_s += time.perf_counter() - t0
            self._done.release()


def create_fill_runner(threads: int) -> InlineFill | FillThread:
    """0: inline on the engine thread; >= 1: a fill thread (the backend splits rows over
    `threads` when more than one)."""
    return InlineFill() if threads == 0 else FillThread()
