"""The front end's end of an engine-core process: start it, talk to it, notice when it dies.

The client binds two ZeroMQ sockets on IPC paths of a private temporary directory (inputs: PUSH,
outputs: PULL), starts `python -m photon.engine.core_proc` (the engine config arrives pickled on
its stdin) and waits for its first message: ready, or the start-up error, raised here with its
type and message. `send` may be called from any thread; `recv` from one reader thread only.
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import zmq

from photon.config import EngineConfig
from photon.engine.core_proc import CoreAddresses
from photon.engine.messages import (
    CoreFailed,
    CoreInput,
    CoreReady,
    CoreStarted,
    Shutdown,
    StepOutputs,
)

_START_TIMEOUT_S = 900.0  # model load and CUDA graph capture included
_POLL_MS = 100


class CoreStartError(RuntimeError):
    """The engine-core process failed to start."""


class CoreClient:
    def __init__(self, config: EngineConfig) -> None:
        self._dir = tempfile.mkdtemp(prefix="photon-core-")
        self.addresses = CoreAddresses(f"ipc://{self._dir}/inputs", f"ipc://{self._dir}/outputs")
        self._ctx = zmq.Context()
        self._inputs = self._ctx.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._inputs.bind(self.addresses.inputs)
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.bind(self.addresses.outputs)
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StepOutputs)
        # A session of its own: a terminal's Ctrl-C reaches the front end only, which stops the
        # core in order (the core never outlives it: it watches its parent).
        self.proc = subprocess.Popen([sys.executable, "-m", "photon.engine.core_proc"],
                                     stdin=subprocess.PIPE, start_new_session=True)
        try:
            self.proc.stdin.write(pickle.dumps((config, self.addresses)))
            self.proc.stdin.close()
            self.ready = self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> CoreReady:
        decoder = msgspec.msgpack.Decoder(CoreStarted)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._outputs.poll(_POLL_MS):
            if self.proc.poll() is not None:
                raise CoreStartError(f"the engine core exited while starting (exit code "
                                     f"{self.proc.returncode})")
            if time.monotonic() > deadline:
                raise CoreStartError(f"the engine core did not start within "
                                     f"{_START_TIMEOUT_S:g} s")
        msg = decoder.decode(self._outputs.recv())
        if isinstance(msg, CoreFailed):
            raise CoreStartError(f"{msg.kind}: {msg.message}")
        return msg

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def send(self, msg: CoreInput) -> None:
        data = self._encoder.encode(msg)
        with self._send_lock:
            self._inputs.send(data, copy=False)

    def recv(self, timeout_ms: int) -> StepOutputs | None:
        """The next step's outputs, or None after `timeout_ms` without one."""
        if not self._outputs.poll(timeout_ms):
            return None
        return self._decoder.decode(self._outputs.recv(copy=False).buffer)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, then make sure it did (terminate, then kill); idempotent."""
        if self.alive:
            try:
                self.send(Shutdown())
            except zmq.ZMQError:
                pass
        for stop, wait_s in ((None, timeout_s), (self.proc.terminate, 5.0),
                             (self.proc.kill, 5.0)):
            if not self.alive:
                break
            if stop is not None:
                stop()
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
