"""The front end's end of an engine-core process: start it (or attach to it), talk to it, notice
when it dies.

A client binds its two ZeroMQ sockets (inputs: PUSH, outputs: PULL) on IPC paths of a private
temporary directory; the core connects to them. `CoreClient.spawn` also starts the core (`python
-m photon.engine.core_proc`, the engine config pickled on its stdin) as its child: one front end.
`CoreClient.attach` is for the API servers of `photon serve --api-server-count N`, whose core the
launcher started with every client's addresses. Either way the client waits for the core's first
message: ready, or the start-up error, raised here with its type and message. `send` may be
called from any thread; `recv` from one reader thread only.
"""

from __future__ import annotations

import os
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
from photon.engine.core_proc import ClientAddresses, client_addresses
from photon.engine.messages import (
    CoreFailed,
    CoreInput,
    CoreOutput,
    CoreReady,
    CoreStarted,
    Shutdown,
)

_START_TIMEOUT_S = 900.0  # model load and CUDA graph capture included
_POLL_MS = 100


class CoreStartError(RuntimeError):
    """The engine-core process failed to start."""


def start_core(config: EngineConfig, clients: list[ClientAddresses],
               env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start an engine-core process that serves `clients` (each binds its own addresses);
    `env`: its environment (default: this process's)."""
    # A session of its own: a terminal's Ctrl-C reaches the front end only, which stops the core
    # in order (the core never outlives it: it watches its parent).
    proc = subprocess.Popen([sys.executable, "-m", "photon.engine.core_proc"],
                            stdin=subprocess.PIPE, start_new_session=True, env=env)
    proc.stdin.write(pickle.dumps((config, clients)))
    proc.stdin.close()
    return proc


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


# How long a send waits for the core's connection between two checks that it is alive.
_SEND_POLL_MS = 100


class CoreGoneError(ConnectionError):
    """A message could not be sent: the core process exited."""


class CoreClient:
    def __init__(self, addresses: ClientAddresses, index: int = 0,
                 directory: str | None = None) -> None:
        self.index = index  # which of the core's front ends this is (tagged on every message)
        self._dir = directory  # removed on close when this client made it
        self.proc: subprocess.Popen | None = None  # the core, when this client started it
        self.core_pid: int | None = None
        self._ctx = zmq.Context()
        self._inputs = self._ctx.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._inputs.bind(addresses.inputs)
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.bind(addresses.outputs)
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreOutput)
        self.ready: CoreReady | None = None

    @classmethod
    def spawn(cls, config: EngineConfig) -> CoreClient:
        """Start a core of its own (this front end is its only client)."""
        return cls.start(config).ready_or_closed()

    @classmethod
    def start(cls, config: EngineConfig, env: dict[str, str] | None = None) -> CoreClient:
        """Start a core of its own without waiting for it (`wait_ready` does)."""
        directory = tempfile.mkdtemp(prefix="photon-core-")
        addresses = client_addresses(directory, 1)
        client = cls(addresses[0], 0, directory)
        try:
            client.proc = start_core(config, addresses, env)
            client.core_pid = client.proc.pid
        except BaseException:
            client.close()
            raise
        return client

    @classmethod
    def attach(cls, addresses: ClientAddresses, index: int, core_pid: int) -> CoreClient:
        """Front end `index` of a core another process started."""
        client = cls(addresses, index)
        client.core_pid = core_pid
        return client.ready_or_closed()

    def ready_or_closed(self) -> CoreClient:
        """This client once its core is ready; closed if the core failed to start."""
        try:
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def wait_ready(self) -> None:
        decoder = msgspec.msgpack.Decoder(CoreStarted)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._outputs.poll(_POLL_MS):
            if not self.alive:
                raise CoreStartError(f"the engine core exited while starting (exit code "
                                     f"{self.exitcode})")
            if time.monotonic() > deadline:
                raise CoreStartError(f"the engine core did not start within "
                                     f"{_START_TIMEOUT_S:g} s")
        msg = decoder.decode(self._outputs.recv())
        if isinstance(msg, CoreFailed):
            raise CoreStartError(f"{msg.kind}: {msg.message}")
        self.ready = msg

    @property
    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.core_pid is not None and pid_alive(self.core_pid)

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def send(self, msg: CoreInput, block: bool = True) -> None:
        """Queue `msg` for the core. A PUSH socket without a connected peer cannot take a
        message: a core that is starting or busy reconnecting is waited for, one that exited
        (even if not yet reaped) raises CoreGoneError instead of blocking forever; block=False
        raises it at once."""
        if hasattr(msg, "client"):
            msg.client = self.index
        data = self._encoder.encode(msg)
        with self._send_lock:
            while True:
                try:
                    self._inputs.send(data, flags=zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    if not block or not self.alive:
                        raise CoreGoneError("the engine core process is gone") from None
                self._inputs.poll(_SEND_POLL_MS, zmq.POLLOUT)

    def recv(self, timeout_ms: int) -> CoreOutput | None:
        """The next step's outputs (or the core's error), or None after `timeout_ms` without
        one."""
        if not self._outputs.poll(timeout_ms):
            return None
        return self._decoder.decode(self._outputs.recv(copy=False).buffer)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the core if this client started it (Shutdown, then terminate, then kill), close
        the sockets; idempotent."""
        if self.proc is not None:
            self._stop_core(timeout_s)
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _stop_core(self, timeout_s: float) -> None:
        if self.alive:
            try:  # a courtesy: terminate and kill follow if the core does not exit
                self.send(Shutdown(), block=False)
            except (zmq.ZMQError, CoreGoneError):
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
