"""Admission control: how many sequences (prompts x n) the server holds at once.

The count is the front end's own: a request's sequences are counted when it is admitted and
uncounted as its prompts finish or are aborted, so requests admitted at the same moment see each
other (the engine's queue statistics only change after a step). Up to `max_running` sequences run
at once (the engine's max_num_seqs); `max_queued` more may wait for a slot. Beyond that a request
gets 429 with Retry-After; a request that could never fit gets 400.
"""

from __future__ import annotations

import threading

from photon.server.errors import APIError, bad_request

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self._in_flight = 0
        self._lock = threading.Lock()  # handlers of several event loops may share one app

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_queued

    @property
    def in_flight(self) -> int:
        """Sequences admitted and not yet finished or aborted."""
        return self._in_flight

    def check_size(self, num_prompts: int, n: int) -> None:
        """400 for a request larger than the server ever holds at once."""
        if num_prompts * n > self.capacity:
            raise bad_request(
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x "
                f"n={n}); this server holds at most {self.capacity} at once ({self.max_running} "
                f"running + {self.max_queued} queued)", "n" if n > 1 else "prompt")

    def admit(self, num_seqs: int) -> Ticket:
        """Count `num_seqs` sequences, or raise 429 when they would not fit now."""
        with self._lock:
            if self._in_flight + num_seqs > self.capacity:
                queued = max(0, self._in_flight - self.max_running)
                raise APIError(429, f"the server is full ({queued} sequences queued, limit "
                                    f"{self.max_queued}); retry later",
                               code="too_many_queued_requests",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            self._in_flight += num_seqs
        return Ticket(self, num_seqs)

    def _release(self, num_seqs: int) -> None:
        with self._lock:
            self._in_flight -= num_seqs


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
