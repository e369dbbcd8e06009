"""RequestSink: the outputs of one or more requests, handed over from an engine's thread to an
asyncio consumer, with back-pressure (a request's untaken outputs are merged into one)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from typing import Any

from photon.outputs import CompletionOutput, RequestOutput


class RequestSink:
    """Outputs of one or more requests, delivered onto the creating asyncio loop.

    Items are `(tag, RequestOutput)` or `(tag, Exception)`. Back-pressure: a request's outputs
    that the consumer has not taken yet are merged into one (`merge_outputs`), so a slow
    consumer gets several steps' tokens at once and what waits here is bounded by the outputs'
    own size, not by the number of steps. Items of different requests keep their order of
    arrival; an exception is never merged."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._lock = threading.Lock()  # _pending and _woken: the producer's thread vs the loop
        self._pending: dict[Any, tuple[Any, RequestOutput | BaseException]] = {}
        self._woken = False  # a wake-up is scheduled on the loop and has not run yet
        self._ready = asyncio.Event()  # loop thread only
        self._errors = itertools.count()  # keys of exceptions: each is its own item

    def put_threadsafe(self, item: tuple[Any, RequestOutput | BaseException]) -> None:
        """Hand an item over from any thread (the engine's, the reader's, the loop's own)."""
        if self.stash(item):
            _wake_all(self.loop, [self])

    def stash(self, item: tuple[Any, RequestOutput | BaseException]) -> bool:
        """Keep `item` (merged with what waits for its request); True if the loop must be woken
        (`hand_over` wakes many sinks with one call)."""
        tag, value = item
        with self._lock:
            if isinstance(value, BaseException):
                self._pending[("error", next(self._errors))] = item
            else:
                held = self._pending.get(value.request_id)
                merged = value if held is None else merge_outputs(held[1], value)
                self._pending[value.request_id] = (tag, merged)
            if self._woken:
                return False
            self._woken = True
            return True

    def _wake(self) -> None:
        with self._lock:
            self._woken = False
        self._ready.set()

    async def get(self) -> tuple[Any, RequestOutput | BaseException]:
        """The oldest item (a request's outputs since the last get, merged)."""
        while True:
            with self._lock:
                if self._pending:
                    key = next(iter(self._pending))
                    return self._pending.pop(key)
                self._ready.clear()
            await self._ready.wait()


def hand_over(ready: list[tuple[RequestSink, tuple[Any, RequestOutput]]]) -> None:
    """Put one step's outputs into their sinks with one wake-up per event loop, not one per
    sink (each cross-thread call writes to the loop's self-pipe)."""
    by_loop: dict[Any, list[RequestSink]] = {}
    for sink, item in ready:
        if sink.stash(item):
            by_loop.setdefault(sink.loop, []).append(sink)
    for loop, sinks in by_loop.items():
        _wake_all(loop, sinks)


def _wake_all(loop: Any, sinks: list[RequestSink]) -> None:
    try:
        loop.call_soon_threadsafe(_wake_sinks, sinks)
    except RuntimeError:
        pass  # the caller's loop is closed: nobody is listening any more


def _wake_sinks(sinks: list[RequestSink]) -> None:
    for sink in sinks:
        sink._wake()


def merge_outputs(first: RequestOutput | BaseException, then: RequestOutput) -> RequestOutput:
    """Two consecutive delta outputs of one request as one: each sequence's token ids, text and
    logprobs concatenated; the latest finish, stop reason, cumulative logprob, error and
    kv_transfer_params;
    the prompt's logprobs and cached-token count from whichever output carried them."""
    assert isinstance(first, RequestOutput)
    children = {c.index: c for c in first.outputs}
    for c in then.outputs:
        held = children.get(c.index)
        children[c.index] = c if held is None else _merge_child(held, c)
    return dataclasses.replace(
        first, outputs=list(children.values()), finished=then.finished,
        metrics=first.metrics if first.metrics is not None else then.metrics,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None
        else then.prompt_logprobs,
        num_cached_tokens=first.num_cached_tokens if first.num_cached_tokens is not None
        else then.num_cached_tokens,
        error=then.error if then.error is not None else first.error,
        kv_transfer_params=then.kv_transfer_params if then.kv_transfer_params is not None
        else first.kv_transfer_params)


def _merge_child(first: CompletionOutput, then: CompletionOutput) -> CompletionOutput:
    logprobs = None if first.logprobs is None and then.logprobs is None \
        else (first.logprobs or []) + (then.logprobs or [])
    # A child stopped by a stop string in the front end may get one more (empty) output with
    # no finish before the core's abort lands: a finish, once given, stays.
    done = then if then.finish_reason is not None else first
    return CompletionOutput(first.index, first.text + then.text,
                            list(first.token_ids) + list(then.token_ids),
                            first.cumulative_logprob if then.cumulative_logprob is None
                            else then.cumulative_logprob, logprobs, done.finish_reason,
                            done.stop_reason)
