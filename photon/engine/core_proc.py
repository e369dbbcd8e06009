"""The engine-core process: the scheduler, KV cache, model runner and pipelined loop, alone.

`run_engine_core` is the process's entry point. Its loop does nothing but engine work: it drains
the input socket (requests, aborts), runs one `EngineCore.step()` and sends one `StepOutputs`
message with every touched request's delta: no HTTP, no detokenization, no JSON. With no work it
blocks on the input socket (waking every second to notice a dead parent: the core never outlives
its front end). SIGTERM and SIGINT end the loop between steps; the front end stops it with a
`Shutdown` message. Cores whose MoE experts span the data-parallel cores step in lockstep
instead (photon.engine.lockstep: the same loop, in rounds agreed with the other cores). If the
loop raises, the core sends every front end a `CoreError` with the exception's type and message,
then exits with the error (its traceback goes to stderr).

For tests of that path, `PHOTON_TEST_CORE_FAULT_STEP=N` (read when the core starts) makes the
core's N-th step (counting from 1) raise `RuntimeError`.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from photon.config import EngineConfig
from photon.engine.engine_core import EngineCore
from photon.engine.lockstep import Lockstep
from photon.engine.messages import (
    Abort,
    AddRequest,
    ChildDelta,
    CoreError,
    CoreFailed,
    CoreInput,
    CoreReady,
    RequestDelta,
    Shutdown,
    StepOutputs,
    Utility,
    UtilityResult,
    Wake,
    refusal,
)
from photon.lora.registry import LoRAAdapters
from photon.outputs import RequestOutput

_IDLE_POLL_MS = 1000
FAULT_STEP_ENV = "PHOTON_TEST_CORE_FAULT_STEP"


def _check_drained(core: EngineCore) -> None:
    assert not core.has_unfinished(), "work still pending (aborts not yet reported?)"
    core.assert_drained()


# What a front end may run in the core between steps (tests, drain checks, pausing, the LoRA
# adapters a server serves by name): called as fn(core, *args).
UTILITIES: dict[str, Callable[..., int | str | LoRAAdapters | None]] = {
    "check_drained": _check_drained,
    "num_running": lambda core: core.stats().num_running,
    "reset_prefix_cache": lambda core: int(core.reset_prefix_cache()),
    "list_lora_adapters": lambda core: core.lora.registry.snapshot(),
    "load_lora_adapter": lambda core, name, path: core.lora.load(name, path),
    "unload_lora_adapter": lambda core, name: core.lora.unload(name),
}


@dataclass(frozen=True)
class ClientAddresses:
    """One front end's sockets: it binds both, the core connects to both."""

    inputs: str  # front end PUSH -> core PULL
    outputs: str  # core PUSH -> front end PULL


def client_addresses(directory: str, count: int) -> list[ClientAddresses]:
    """IPC addresses for `count` front ends (API servers) in a private directory."""
    return [ClientAddresses(f"ipc://{directory}/inputs-{i}", f"ipc://{directory}/outputs-{i}")
            for i in range(count)]


def main() -> None:
    """`python -m photon.engine.core_proc`: the engine config and socket addresses come pickled
    on stdin from the front end (`CoreClient`), which started this process."""
    config, clients = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    run_engine_core(config, clients)
    # Stopped cleanly (the engine, its grammar worker and sockets are shut down): leave without
    # the interpreter's teardown of torch and the rest, most of a second that the front end's
    # shutdown would wait for. A failure raised above still exits through it, with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_engine_core(config: EngineConfig, clients: list[ClientAddresses]) -> None:
    """Connect to every front end, build the engine, report ready (or the start-up error) to
    each, serve. One input socket takes every front end's messages; each front end gets the
    outputs of its own requests (and every step's stats) on its own socket."""
    stop = {"now": False}

    def on_signal(signum: int, frame: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    outputs = []
    for client in clients:
        inputs.connect(client.inputs)
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.SNDHWM, 0)  # never block the loop on a slow front end
        out.connect(client.outputs)
        outputs.append(out)
    encoder = msgspec.msgpack.Encoder()
    core = None
    try:
        core = EngineCore(config, detokenize=False)
        core.structured.start()  # the grammar worker boots now, not with the first grammar
        _send_all(outputs, encoder.encode(CoreReady(core.runner.num_blocks, os.getpid())))
        _CoreLoop(core, inputs, outputs, stop, _fault_step()).run()
    except Exception as e:  # noqa: BLE001 - reported to the front ends, which raise it
        if core is None:
            _send_all(outputs, encoder.encode(CoreFailed(type(e).__name__, str(e))))
        else:
            _send_all(outputs, encoder.encode(CoreError(type(e).__name__, str(e))))
            raise
    finally:
        if core is not None:
            core.structured.shutdown()
            core.shutdown()
        inputs.close(linger=0)
        for out in outputs:
            out.close(linger=1000)
        ctx.term()


def _fault_step() -> int | None:
    """The step that raises on purpose (tests only: `PHOTON_TEST_CORE_FAULT_STEP`), or None."""
    value = os.environ.get(FAULT_STEP_ENV)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{FAULT_STEP_ENV}={value!r}: a step number >= 1")
    return int(value)


def _send_all(outputs: list[zmq.Socket], data: bytes) -> None:
    for out in outputs:
        out.send(data, copy=False)


class _CoreLoop:
    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: list[zmq.Socket],
                 stop: dict[str, bool], fault_step: int | None = None) -> None:
        self.core = core
        self.fault_step = fault_step
        self.num_steps = 0
        self.inputs = inputs
        self.outputs = outputs
        self.stop = stop
        self.decoder = msgspec.msgpack.Decoder(CoreInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.parent = os.getppid()
        self.client_of: dict[str, int] = {}  # request id -> the front end that sent it
        # Per front end: answers to adds (refusals; acceptances of adapter requests) and utility
        # calls answered, sent with the next send.
        self.replies: list[list[RequestDelta]] = [[] for _ in outputs]
        self.results: list[list[UtilityResult]] = [[] for _ in outputs]
        self.paused = False  # no step runs while paused (inputs are still applied)
        # Lockstep cores (photon.engine.lockstep): the wake-ups seen, and a Shutdown received.
        self.wakeups = 0
        self.stopping = False
        experts = core.dp_experts
        self.lockstep = None if experts is None else Lockstep(experts, core.runner)

    def run(self) -> None:
        if self.lockstep is not None:
            self._run_lockstep(self.lockstep)
            return
        last_end: float | None = None
        while not self.stop["now"] and os.getppid() == self.parent:
            busy = self.core.has_work() and not self.paused
            if not self._receive(block=not busy):
                break
            if self.paused or not self.core.has_work():
                self._send([], None, None)  # answers to adds, and gauges back to zero
                last_end = None
                continue
            start = time.monotonic()
            outs = self._step()
            end = time.monotonic()
            gap = start - last_end if last_end is not None else None
            self._send(outs, end - start, gap)
            last_end = end if self.core.has_unfinished() else None

    def _run_lockstep(self, lock: Lockstep) -> None:
        """Rounds agreed with the other cores: one forward each (a dummy one without work) while
        any core has work; idle on the inputs together otherwise."""
        while not self.stop["now"] and os.getppid() == self.parent:
            ready = self._receive(block=False)
            while ready and lock.must_wait(self.wakeups):
                ready = self._receive(block=True)
            if not ready and not self.stopping:
                return  # a signal, or the front end is gone: leave at once
            has_work = self.core.has_work() and not self.paused and not self.stopping
            agreed = lock.agree(has_work, self.wakeups, self.stopping)
            if agreed.stop:
                return
            if not agreed.any_work:
                self._send([], None, None)  # rejected adds, utility results, gauges
                continue
            start = time.monotonic()
            outs = lock.step(self._step if has_work else list)
            self._send(outs, time.monotonic() - start, None)

    def _step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.num_steps == self.fault_step:
            raise RuntimeError(f"fault injected at step {self.num_steps} "
                               f"({FAULT_STEP_ENV})")
        return self.core.step()

    def _receive(self, block: bool) -> bool:
        """Apply every queued input (waiting for one when idle); False once told to stop."""
        if block:
            while not self.inputs.poll(_IDLE_POLL_MS):
                if self.stop["now"] or os.getppid() != self.parent:
                    return False
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            if not self._apply(self.decoder.decode(frame.buffer)):
                return False

    def _apply(self, msg: CoreInput) -> bool:
        if isinstance(msg, (AddRequest, Utility, Wake, Shutdown)):
            self.wakeups += 1  # the messages every core gets in equal number (lockstep)
        if isinstance(msg, AddRequest):
            try:
                self.core.add_request(msg.prompt_token_ids, msg.params, msg.request_id,
                                      delta=True, kv_transfer_params=msg.kv_transfer_params,
                                      lora_request=msg.lora_request)
                self.client_of[msg.request_id] = msg.client
            except Exception as e:  # noqa: BLE001 - one request must not stop the core
                self.replies[msg.client].append(RequestDelta(
                    msg.request_id, [], True, error=str(e), refused=refusal(e)))
                return True
            if msg.lora_request is not None:  # its front end awaits the check of its adapter
                self.replies[msg.client].append(RequestDelta(msg.request_id, [], False,
                                                             accepted=True))
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                self.core.abort(rid)
        elif isinstance(msg, Utility):
            self.results[msg.client].append(self._utility(msg))
        elif isinstance(msg, Shutdown):
            self.stopping = True
            return False
        return True

    def _utility(self, msg: Utility) -> UtilityResult:
        if msg.method in ("pause", "resume"):
            self.paused = msg.method == "pause"
            return UtilityResult(msg.call_id)
        fn = UTILITIES.get(msg.method)
        if fn is None:
            return UtilityResult(msg.call_id, error=f"unknown utility {msg.method!r}")
        try:
            return UtilityResult(msg.call_id, fn(self.core, *msg.args))
        except Exception as e:  # noqa: BLE001 - the caller gets it
            return UtilityResult(msg.call_id, error=f"{type(e).__name__}: {e}")

    def _send(self, outs: list[RequestOutput], step_s: float | None, gap_s: float | None
              ) -> None:
        deltas = self.replies
        for out in outs:
            client = self.client_of.get(out.request_id, 0)
            if out.finished:
                self.client_of.pop(out.request_id, None)
            deltas[client].append(_delta(out))
        stats = self.core.stats()
        for i, sock in enumerate(self.outputs):
            msg = StepOutputs(deltas[i], stats, step_s, gap_s, self.results[i])
            sock.send(self.encoder.encode(msg), copy=False)
        self.replies = [[] for _ in self.outputs]
        self.results = [[] for _ in self.outputs]


def _delta(out: RequestOutput) -> RequestDelta:
    children = [ChildDelta(c.index, c.token_ids, c.finish_reason, c.stop_reason,
                           c.cumulative_logprob, c.logprobs) for c in out.outputs]
    m = out.metrics
    return RequestDelta(out.request_id, children, out.finished,
                        None if m is None else m.first_scheduled_time, out.prompt_logprobs,
                        out.num_cached_tokens, out.error, out.kv_transfer_params,
                        first_token_time=None if m is None else m.first_token_time)


if __name__ == "__main__":
    main()
