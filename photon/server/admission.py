"""Admission control: how many sequences (prompts x n) the server holds at once.

The count is the front end's own: a request's sequences are counted when it is admitted and
uncounted as its prompts finish or are aborted, so requests admitted at the same moment see each
other (the engine's queue statistics only change after a step). Up to `max_running` sequences run
at once (the engine's max_num_seqs); `max_queued` more may wait for a slot. Beyond that a request
gets 429 with Retry-After; a request that could never fit gets 400.

With several API servers (`--api-server-count N`) the limits are the deployment's, not each
server's: every server keeps its count in one shared file (`SharedCount`, 8 bytes mapped into each
process, updated under an exclusive `flock`), so the flags mean what they mean with one server
whichever server a connection lands on (a keep-alive client stays on one).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import threading
from collections.abc import Iterator

from photon.server.errors import APIError, bad_request

RETRY_AFTER_S = 1


class LocalCount:
    """The count of one API server."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()  # handlers of several event loops may share one app

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._lock:
            yield


class SharedCount:
    """A count every API server of one deployment shares: an int64 in a file (`create` makes
    it), read and written only under `locked()`."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, 8)
        self._lock = threading.Lock()  # flock does not exclude this process's other threads

    @staticmethod
    def create(path: str) -> None:
        with open(path, "wb") as f:
            f.write(bytes(8))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def value(self) -> int:
        return struct.unpack_from("<q", self._map)[0]

    @value.setter
    def value(self, count: int) -> None:
        struct.pack_into("<q", self._map, 0, count)


class Admission:
    def __init__(self, max_running: int, max_queued: int, shared: str | None = None) -> None:
        """`shared`: the file of a `SharedCount` (several API servers); None: a count of this
        server's own."""
        self.max_running = max_running
        self.max_queued = max_queued
        self._count = LocalCount() if shared is None else SharedCount(shared)

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_queued

    @property
    def in_flight(self) -> int:
        """Sequences admitted and not yet finished or aborted (by every API server)."""
        with self._count.locked():
            return self._count.value

    def check_size(self, num_prompts: int, n: int) -> None:
        """400 for a request larger than the server ever holds at once."""
        if num_prompts * n > self.capacity:
            raise bad_request(
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x "
                f"n={n}); this server holds at most {self.capacity} at once ({self.max_running} "
                f"running + {self.max_queued} queued)", "n" if n > 1 else "prompt")

    def admit(self, num_seqs: int) -> Ticket:
        """Count `num_seqs` sequences, or raise 429 when they would not fit now."""
        with self._count.locked():
            in_flight = self._count.value
            if in_flight + num_seqs > self.capacity:
                queued = max(0, in_flight - self.max_running)
                raise APIError(429, f"the server is full ({queued} sequences queued, limit "
                                    f"{self.max_queued}); retry later",
                               code="too_many_queued_requests",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            self._count.value = in_flight + num_seqs
        return Ticket(self, num_seqs)

    def _release(self, num_seqs: int) -> None:
        with self._count.locked():
            self._count.value -= num_seqs


class Ticket:
    """The sequences one admitted request still holds; releasing is idempotent."""

    def __init__(self, admission: Admission, num_seqs: int) -> None:
        self._admission = admission
        self.held = num_seqs

    def release(self, num_seqs: int) -> None:
        num_seqs = min(num_seqs, self.held)
        self.held -= num_seqs
        self._admission._release(num_seqs)

    def release_all(self) -> None:
        self.release(self.held)
