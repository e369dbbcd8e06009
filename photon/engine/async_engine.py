"""AsyncEngine: runs EngineCore's loop in its own thread and gives asyncio callers output streams.

Thread handoff:
- callers (any asyncio loop) put commands (add / abort / call / stop) into a
  `queue.SimpleQueue`; the engine thread is the only one that touches the EngineCore (`call`
  runs a function there, between two steps);
- outputs go back into the caller's `RequestSink` (photon.engine.request_sink), which wakes
  the caller's loop; one sink may collect several requests, tagged, e.g. every prompt of one
  HTTP request, and merges a request's outputs the caller has not taken yet;
- with no unfinished work the engine thread blocks on the command queue (no busy spin).

Requests are added in delta mode: each output carries only new tokens/text. If `step()` raises,
the thread records the error, fails every open stream with `EngineDeadError`, refuses new requests
(`EngineUnavailableError`) and exits; `healthy` turns false.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from photon.engine.engine_core import EngineCore, EngineStats
from photon.engine.request_sink import RequestSink
from photon.lora.request import LoRARequest
from photon.outputs import RequestOutput
from photon.sampling_params import SamplingParams

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine has stopped (an internal error, its process died, or shutdown); no request can
    run. A request that was running when it stopped fails with this error."""


class EngineUnavailableError(EngineDeadError):
    """A new request refused because the engine has stopped (the server answers 503)."""


class EngineObserver(Protocol):
    """Receives engine-thread events (metrics); every method runs on the engine thread."""

    def on_step(self, step_s: float | None, gap_s: float | None, stats: EngineStats) -> None:
        """After each loop iteration: the step's duration (None: no step ran), the host gap
        before it (None: the engine was idle or blocked in between) and a stats snapshot."""

    def on_output(self, entry: TrackedRequest, output: RequestOutput, now: float) -> None:
        """For each output, before it is handed to the caller."""


@dataclass
class TrackedRequest:
    """Engine-thread bookkeeping of one live request (timestamps are time.monotonic())."""

    request_id: str
    sink: RequestSink
    tag: Any
    arrival_time: float  # when the server received it
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _Add:
    prompt_ids: list[int]
    params: SamplingParams
    entry: TrackedRequest
    done: Callable[[BaseException | None], None]
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: LoRARequest | None = None


@dataclass
class _Call:
    fn: Callable[[], Any]
    result: concurrent.futures.Future[Any]


@dataclass
class _Counters:
    """Caller-side view, refreshed by the engine thread after every iteration."""

    num_waiting: int = 0
    num_running: int = 0
    # The engine's LoRA registry version (LoRAStats.adapters_version): a server's copy of the
    # adapter names older than it is refreshed.
    lora_version: int = 0

    def update_lora(self, stats: EngineStats) -> None:
        if stats.lora is not None:
            self.lora_version = stats.lora.adapters_version


class _NullObserver:
    def on_step(self, step_s: float | None, gap_s: float | None, stats: EngineStats) -> None:
        pass

    def on_output(self, entry: TrackedRequest, output: RequestOutput, now: float) -> None:
        pass


class StreamsRequests:
    """`generate` of both engine front ends (AsyncEngine, AsyncLLM): `stream_request` over the
    front end's own add_request / abort."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 kv_transfer_params: dict[str, Any] | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """One request's delta outputs; leaving the loop early aborts the request.
        kv_transfer_params: disaggregation (RequestOutput.kv_transfer_params on a prefill
        instance's final output); lora_request: its LoRA adapter (None: the base model)."""
        return stream_request(self, prompt_ids, params, request_id, kv_transfer_params,
                              lora_request)


class AsyncEngine(StreamsRequests):
    def __init__(self, engine: EngineCore, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self.observer: EngineObserver = observer or _NullObserver()
        self.error: BaseException | None = None
        self.counters = _Counters()
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: dict[str, TrackedRequest] = {}  # engine thread only
        self._stop = False
        self._paused = False  # no step runs while paused (engine thread only)
        self._thread = threading.Thread(target=self._run, name="photon-engine", daemon=True)

    @property
    def frontend(self) -> EngineCore:
        """What the API server reads of the engine (config, tokenizer, edge checks): here the
        EngineCore itself, read-only."""
        return self.engine

    # ---- lifecycle (caller side) ------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if not self._thread.is_alive() and not self._stop:
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(("stop",))
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.structured.shutdown()  # compile threads and the grammar worker
            self.engine.kv_events.shutdown()  # the KV events publisher thread and sockets

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self._stop

    # ---- requests (caller side) -------------------------------------------------------------
    async def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                          sink: RequestSink, tag: Any = None,
                          arrival_time: float | None = None,
                          kv_transfer_params: dict[str, Any] | None = None,
                          lora_request: LoRARequest | None = None) -> None:
        """Queue a request whose outputs go to `sink`; raises the engine's ValueError."""
        self._check_alive()
        entry = TrackedRequest(request_id, sink, tag, arrival_time or time.monotonic(),
                               len(prompt_ids))
        fut: asyncio.Future[None] = sink.loop.create_future()

        def done(exc: BaseException | None) -> None:
            try:
                sink.loop.call_soon_threadsafe(_resolve, fut, exc)
            except RuntimeError:
                pass  # the caller's loop is closed

        try:
            self._inbox.put(_Add(prompt_ids, params, entry, done, kv_transfer_params,
                                 lora_request))
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still land: abort it right behind
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown or finished ids are ignored)."""
        self._inbox.put(("abort", request_id))

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Run `fn` on the engine thread between two steps and return its result (blocking the
        calling thread): a consistent look at the EngineCore from outside, e.g. in tests."""
        self._check_alive()
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inbox.put(_Call(fn, result))
        return result.result(timeout)

    def call_utility(self, method: str, timeout: float = 30.0, args: tuple[str, ...] = ()
                     ) -> Any:
        """AsyncLLM.call_utility's methods, run on the engine thread between two steps."""
        from photon.engine.core_proc import UTILITIES

        def run() -> Any:
            if method in ("pause", "resume"):
                self._paused = method == "pause"
                return None
            if method not in UTILITIES:
                raise RuntimeError(f"unknown utility {method!r}")
            return UTILITIES[method](self.engine, *args)

        return self.call(run, timeout)

    def _check_alive(self) -> None:
        if not self.healthy:
            raise EngineUnavailableError(stopped_message(self.error))

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine; report it
            self.error = e
            self._fail_all(EngineDeadError(f"the engine stopped after an internal error: {e!r}"))

    def _loop(self) -> None:
        last_end: float | None = None  # end of the previous step, if work remained after it
        while not self._stop:
            idle = self._paused or not self.engine.has_work()
            self._drain_inbox(block=idle)
            if self._stop or self._paused or not self.engine.has_work():
                self._publish(None, None)  # gauges drop to zero once drained
                last_end = None
                continue
            start = time.monotonic()
            outputs = self.engine.step()
            end = time.monotonic()
            self._dispatch(outputs, end)
            gap = start - last_end if last_end is not None else None
            self._publish(end - start, gap)
            last_end = end if self.engine.has_unfinished() else None
        self._fail_all(EngineDeadError("the engine is shutting down"))

    def _drain_inbox(self, block: bool) -> None:
        try:
            cmd = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            self._handle_add(cmd)
        elif isinstance(cmd, _Call):
            _run_call(cmd)
        elif cmd[0] == "abort":
            if cmd[1] in self._live:
                self.engine.abort(cmd[1])
        elif cmd[0] == "stop":
            self._stop = True

    def _handle_add(self, cmd: _Add) -> None:
        if self._stop:
            cmd.done(EngineUnavailableError("the engine is shutting down"))
            return
        rid = cmd.entry.request_id
        try:
            self.engine.add_request(cmd.prompt_ids, cmd.params, rid, delta=True,
                                    kv_transfer_params=cmd.kv_transfer_params,
                                    lora_request=cmd.lora_request)
        except Exception as e:  # noqa: BLE001 - a bad request must not kill the engine thread
            cmd.done(e)
            return
        self._live[rid] = cmd.entry
        cmd.done(None)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            entry = self._live.get(out.request_id)
            if entry is None:
                continue
            self.observer.on_output(entry, out, now)
            entry.sink.put_threadsafe((entry.tag, out))
            if out.finished:
                del self._live[out.request_id]

    def _publish(self, step_s: float | None, gap_s: float | None) -> None:
        stats = self.engine.stats()
        self.counters.num_waiting = stats.num_waiting
        self.counters.num_running = stats.num_running
        self.counters.update_lora(stats)
        self.observer.on_step(step_s, gap_s, stats)

    def _fail_all(self, exc: BaseException) -> None:
        self._stop = True
        for entry in self._live.values():
            entry.sink.put_threadsafe((entry.tag, exc))
        self._live.clear()
        while True:  # adds that never reached the engine
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                cmd.done(EngineUnavailableError(str(exc)))
            elif isinstance(cmd, _Call):
                cmd.result.set_exception(exc)


class _Streaming(Protocol):
    async def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                          sink: RequestSink, *,
                          kv_transfer_params: dict[str, Any] | None = None,
                          lora_request: LoRARequest | None = None) -> None: ...

    def abort(self, request_id: str) -> None: ...


async def stream_request(engine: _Streaming, prompt_ids: list[int], params: SamplingParams,
                         request_id: str, kv_transfer_params: dict[str, Any] | None = None,
                         lora_request: LoRARequest | None = None
                         ) -> AsyncIterator[RequestOutput]:
    """`generate` of AsyncEngine and AsyncLLM: one request's delta outputs from its own sink;
    an error put in the sink is raised; leaving the loop before the final output aborts the
    request."""
    sink = RequestSink()
    extra = {} if lora_request is None else {"lora_request": lora_request}
    await engine.add_request(prompt_ids, params, request_id, sink,
                             kv_transfer_params=kv_transfer_params, **extra)
    finished = False
    try:
        while not finished:
            _, item = await sink.get()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            engine.abort(request_id)


def stopped_message(error: BaseException | None) -> str:
    """Why no new request can run, naming the cause when there is one."""
    if error is None:
        return "the engine has stopped"
    text = str(error) if isinstance(error, EngineDeadError) else f"{type(error).__name__}: {error}"
    return f"the engine has stopped: {text}"


def _run_call(cmd: _Call) -> None:
    try:
        cmd.result.set_result(cmd.fn())
    except Exception as e:  # noqa: BLE001 - the caller gets it
        cmd.result.set_exception(e)


def _resolve(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
