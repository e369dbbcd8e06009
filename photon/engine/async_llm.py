"""AsyncLLM: the front end of an engine-core process, with AsyncEngine's interface.

The engine core (scheduler, KV cache, model runner, pipelined loop) runs in a process of its own
(photon.engine.core_proc), so nothing here takes the GIL from the loop that feeds the GPU. This
process keeps what is per request and not per step: the edge checks (`RequestChecks`: a request
the core receives never fails them), detokenization and stop strings (`OutputProcessor`), logprob
texts, and the callers' output streams. One reader thread receives the core's per-step messages
and hands each request's delta output to its `RequestSink`. If the core process dies, every open
stream fails with `EngineDeadError`, `healthy` turns false and `dead` is set. If its loop raised,
the core says why first (`CoreError`): the cause is logged once, and every open and later request
fails with `EngineUnavailableError` naming the exception. With `--data-parallel-size N` there are
N cores (photon.engine.core_group: each request goes to the least-loaded one), one reader thread
each; any core's death or error ends the whole engine as above.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import itertools
import logging
import signal
import threading
import time
from typing import Any

from photon.config import EngineConfig
from photon.engine.async_engine import (
    EngineDeadError,
    EngineObserver,
    EngineUnavailableError,
    RequestSink,
    StreamsRequests,
    TrackedRequest,
    _Counters,
    _NullObserver,
    stopped_message,
)
from photon.engine.core_client import CoreClient, CoreGoneError
from photon.engine.core_group import CoreGroup, combine_stats
from photon.engine.engine_core import EngineStats
from photon.engine.messages import (
    Abort,
    AddRequest,
    CoreError,
    CoreInput,
    StepOutputs,
    Utility,
    UtilityResult,
    Wake,
    refusal_error,
)
from photon.engine.output_processor import OutputProcessor
from photon.engine.request_checks import RequestChecks
from photon.engine.request_sink import hand_over
from photon.kv_transfer.params import parse_kv_transfer_params
from photon.lora.request import LoRARequest
from photon.outputs import RequestOutput
from photon.reasoning import ReasoningParser, get_reasoning_parser
from photon.sampling_params import SamplingParams
from photon.structured.manager import StructuredOutputManager
from photon.tokenizer import Tokenizer

_POLL_MS = 100  # how often the reader looks at the core process while no output comes
logger = logging.getLogger(__name__)


class Frontend:
    """What the API server reads of the engine: config, tokenizer, the edge checks, the
    reasoning parser and a grammar compiler for early 400s (its own, inline: no worker)."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.checks = RequestChecks(config, tokenizer)
        self.reasoning: ReasoningParser | None = None if config.reasoning_parser is None \
            else get_reasoning_parser(config.reasoning_parser)(tokenizer)
        self.structured = StructuredOutputManager(
            dataclasses.replace(config.structured_outputs, worker="inline"), tokenizer,
            config.model.vocab_size, max_rows=config.scheduler.max_num_seqs, cuda=False)

    def tokenize_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        return self.checks.tokenize_prompt(prompt)

    def check_fits(self, num_prompt: int, max_tokens: int | None) -> None:
        self.checks.check_fits(num_prompt, max_tokens)


def _send(client: CoreClient, msg: CoreInput, required: bool = True) -> None:
    """Send to a core. If it is gone, a required message (a request, a utility call) raises
    EngineDeadError; an abort is dropped (the reader fails the core's requests anyway)."""
    try:
        client.send(msg)
    except CoreGoneError:
        if required:
            raise EngineDeadError(exit_cause(client.exitcode)) from None


def exit_cause(code: int | None) -> str:
    """What became of the engine-core process, from its exit status."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the engine core process was killed by {name}"
    status = "" if code is None else f"exit code {code}; "  # None: another process's child
    return (f"the engine core process exited unexpectedly ({status}its error, if it raised "
            f"one, is in the log above)")


class AsyncLLM(StreamsRequests):
    def __init__(self, config: EngineConfig, observer: EngineObserver | None = None,
                 client: CoreClient | None = None) -> None:
        """`client`: attach to a core another process started (`CoreClient.attach`); by
        default this front end starts a core of its own."""
        self.frontend = Frontend(config, Tokenizer.from_pretrained(config.model.model))
        self.observer: EngineObserver = observer or _NullObserver()
        self.error: BaseException | None = None
        self.counters = _Counters()
        self.dead = threading.Event()  # set when the core process died
        self._processor = OutputProcessor(self.frontend.tokenizer)
        # By the core's id of each request: the caller's id plus a sequence number, so that a
        # caller may reuse an id as soon as its request finished here, even while the core
        # still runs the old request's last step.
        self._live: dict[str, TrackedRequest] = {}
        self._core_ids: dict[str, str] = {}  # caller's id -> core's id, while live
        self._seq = itertools.count()
        self._lock = threading.Lock()  # _live and the processor: callers' threads vs the reader
        self._stop = False
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}  # utility calls in flight
        self._answers: dict[str, _Answer] = {}  # adapter requests' adds awaiting the core
        self._call_ids = itertools.count()
        # Starts the core processes (raises a start-up error), unless attached to one.
        self.cores = CoreGroup([client]) if client is not None else CoreGroup.spawn(config)
        self._stats: list[EngineStats | None] = [None] * len(self.cores.clients)
        self._stats_lock = threading.Lock()  # the latest stats of each core, and the observer
        self._readers = [threading.Thread(target=self._read, args=(c,), daemon=True,
                                          name=f"photon-outputs-{i}")
                         for i, c in enumerate(self.cores.clients)]
        # Everything alive now (tokenizer tables, the grammar compiler) stays out of the
        # collector's reach: every step's messages allocate many small objects, and each
        # collection would otherwise rescan all of it on the thread that hands out the outputs.
        gc.collect()
        gc.freeze()

    # ---- lifecycle ------------------------------------------------------------------------------
    @property
    def client(self) -> CoreClient:
        """The (first) engine core's client."""
        return self.cores.clients[0]

    def start(self) -> None:
        for reader in self._readers:
            if not reader.is_alive() and not self._stop:
                reader.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        for reader in self._readers:
            if reader.is_alive():
                reader.join(timeout)
        self.cores.close()
        self.frontend.structured.shutdown()
        self._fail_all(EngineDeadError("the engine is shutting down"))

    def abort_all(self, reason: str) -> None:
        """End every open request now (the server is stopping): the core aborts them, their
        streams fail with `EngineUnavailableError(reason)`."""
        self._abort_on_cores()
        self._fail_all(EngineUnavailableError(reason))

    def _abort_on_cores(self) -> None:
        """Tell each live core to abort the open requests it owns."""
        with self._lock:
            owned = [(self.cores.owner(core_id), core_id) for core_id in self._live]
        for client in self.cores.clients:
            ids = [core_id for owner, core_id in owned if owner is client]
            if ids and client.alive:
                _send(client, Abort(ids), required=False)

    @property
    def healthy(self) -> bool:
        return self.error is None and not self._stop and self.cores.alive

    # ---- requests -------------------------------------------------------------------------------
    async def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                          sink: RequestSink, tag: Any = None,
                          arrival_time: float | None = None,
                          kv_transfer_params: dict[str, Any] | None = None,
                          lora_request: LoRARequest | None = None) -> None:
        """Check the request (raises ValueError) and send it to the core. With an adapter,
        wait for the core's check of it, and raise what that raises as the in-process engine
        does: AdapterNotFoundError for an adapter unloaded meanwhile (through another API
        server), ValueError for a bad one."""
        self._check_alive()
        self.frontend.checks.check(prompt_ids, params)
        parse_kv_transfer_params(kv_transfer_params)  # its key errors, before it is queued
        arrival = arrival_time or time.monotonic()
        entry = TrackedRequest(request_id, sink, tag, arrival, len(prompt_ids))
        answer = _Answer(lora_request.lora_name) if lora_request is not None else None
        with self._lock:
            self._check_alive()  # again, under the lock: the reader may have failed all since
            if request_id in self._core_ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            core_id = f"{request_id}#{next(self._seq)}"
            self._core_ids[request_id] = core_id
            self._live[core_id] = entry
            self._processor.add(core_id, request_id, prompt_ids, params, arrival)
            client = self.cores.assign(core_id)  # n > 1: the core runs every child
            if answer is not None:
                self._answers[core_id] = answer
        _send(client, AddRequest(core_id, prompt_ids, params, arrival,
                                 kv_transfer_params=kv_transfer_params,
                                 lora_request=lora_request))
        for other in self.cores.others(client):  # lockstep cores join the request's steps
            _send(other, Wake())
        if answer is not None:
            try:
                await asyncio.wrap_future(answer.future)
            except asyncio.CancelledError:
                self.abort(request_id)  # accepted or not: abort it right behind
                raise

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown or finished ids are ignored)."""
        with self._lock:
            core_id = self._core_ids.get(request_id)
            client = None if core_id is None else self.cores.owner(core_id)
        if client is not None and client.alive:
            _send(client, Abort([core_id]), required=False)

    def call_utility(self, method: str, timeout: float = 30.0, args: tuple[str, ...] = ()
                     ) -> Any:
        """Run one of the core's utility methods (photon.engine.core_proc.UTILITIES, or
        "pause" / "resume": no step runs while paused) between two steps; blocks the calling
        thread for its result. A failed check raises AssertionError, other errors RuntimeError.
        With several cores every core runs it; integer results add up, otherwise the first
        core's result is returned."""
        self._check_alive()
        futs = [self._call(client, method, args) for client in self.cores.clients]
        values = [fut.result(timeout) for fut in futs]
        if len(values) > 1 and all(isinstance(v, int) for v in values):
            return sum(values)
        return values[0]

    def _call(self, client: CoreClient, method: str, args: tuple[str, ...]
              ) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._check_alive()
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
        _send(client, Utility(call_id, method, args=list(args)))
        return fut

    def _check_alive(self) -> None:
        if self.healthy:
            return
        cause = self.error
        dead = self.cores.first_dead()
        if cause is None and dead is not None:  # dead, and its reader has not seen it yet
            cause = EngineDeadError(exit_cause(dead.exitcode))
        raise EngineUnavailableError(stopped_message(cause))

    # ---- the reader thread ----------------------------------------------------------------------
    def _read(self, client: CoreClient) -> None:
        """One core's reader thread."""
        while not self._stop:
            msg = client.recv(_POLL_MS)
            if msg is None:
                if not client.alive and not self._stop:
                    self._after_exit(client)
                    return
            elif isinstance(msg, CoreError):
                self._core_failed(msg)
                return
            else:
                self._on_step(client, msg)

    def _on_step(self, client: CoreClient, msg: StepOutputs) -> None:
        now = time.monotonic()
        ready: list[tuple[RequestSink, tuple[Any, RequestOutput]]] = []
        for delta in msg.requests:
            self._dispatch(client, delta, now, ready)
        hand_over(ready)
        with self._stats_lock:
            self._stats[self.cores.clients.index(client)] = msg.stats
            stats = combine_stats([s for s in self._stats if s is not None])
            self.counters.num_waiting = stats.num_waiting
            self.counters.num_running = stats.num_running
            self.counters.update_lora(stats)
            self.observer.on_step(msg.step_s, msg.gap_s, stats)
        # After the stats: a caller woken by its result sees the state the call left (the LoRA
        # registry's version after a load or unload).
        for result in msg.utility:
            self._answer(result)

    def _after_exit(self, client: CoreClient) -> None:
        """A core process has exited: take what it sent last (its error, if its loop raised,
        may still be on its way), then fail everything with the best cause known."""
        while (msg := client.recv(_POLL_MS)) is not None:
            if isinstance(msg, CoreError):
                self._core_failed(msg)
                return
            self._on_step(client, msg)
        self._core_died(EngineDeadError(exit_cause(client.exitcode)))

    def _core_failed(self, msg: CoreError) -> None:
        logger.error("photon: %s", msg.describe())
        self._core_died(EngineUnavailableError(msg.describe()))

    def _dispatch(self, client: CoreClient, delta: Any, now: float,
                  ready: list[tuple[RequestSink, tuple[Any, RequestOutput]]]) -> None:
        with self._lock:
            answer = self._answers.pop(delta.request_id, None)
            entry = None if delta.accepted else self._live.get(delta.request_id)
            if entry is not None:
                out, stopped = self._processor.process(delta)
                if out is not None and out.finished:
                    del self._live[delta.request_id]
                    self._core_ids.pop(entry.request_id, None)
                    self.cores.release(delta.request_id)
        if answer is not None:
            answer.give(None if delta.refused is None else
                        refusal_error(delta.refused, delta.error or "", answer.lora_name))
            if delta.refused is not None:
                return  # its add_request raises it: no output
        if entry is None:
            return
        if stopped:
            _send(client, Abort(stopped), required=False)
        if out is not None:
            self.observer.on_output(entry, out, now)
            ready.append((entry.sink, (entry.tag, out)))

    def _answer(self, result: UtilityResult) -> None:
        with self._lock:
            fut = self._calls.pop(result.call_id, None)
        if fut is None:
            return
        if result.error is None:
            fut.set_result(result.value)
        elif result.error.startswith("AssertionError"):
            fut.set_exception(AssertionError(result.error))
        else:
            fut.set_exception(RuntimeError(result.error))

    def _core_died(self, error: EngineDeadError) -> None:
        # Every request and call added before this point is failed below; later ones see
        # `error` under the lock and are refused.
        with self._lock:
            self.error = error
        self._abort_on_cores()  # the other cores' requests end with the engine
        self._fail_all(self.error)
        self.dead.set()

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            live, self._live = list(self._live.items()), {}
            self._core_ids = {}
            self.cores.clear()
            calls, self._calls = list(self._calls.values()), {}
            answers, self._answers = list(self._answers.values()), {}
            for core_id, _ in live:
                self._processor.remove(core_id)
        live = [entry for _, entry in live]
        for entry in live:
            entry.sink.put_threadsafe((entry.tag, exc))
        for fut in calls:
            fut.set_exception(exc)
        for answer in answers:
            answer.give(exc)


class _Answer:
    """The core's answer to an adapter request's add, awaited by add_request."""

    def __init__(self, lora_name: str) -> None:
        self.lora_name = lora_name
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()

    def give(self, error: BaseException | None) -> None:
        try:
            if error is None:
                self.future.set_result(None)
            else:
                self.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass  # its add_request was cancelled (its request is aborted)
