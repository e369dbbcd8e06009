"""The grammar-worker process: matchers, accepts and mask fills beside the engine thread.

`ProcessExecutor` (engine side) starts `python -m photon.structured.worker` with three inherited file
descriptors: a socket for messages, a file with the engine's tokenizer, and a shared-memory file for
a step's arrays and both pipeline slots' mask buffers (registered with CUDA on the engine side,
so their H2D copies are asynchronous). A fresh interpreter, not multiprocessing: it never re-imports the user's script.

Messages, in order on one socket (engine -> worker):
  ("compile", key, spec)   compile a grammar the engine is compiling too (it validated it)
  ("forget", key)          the engine's cache dropped it
  ("open", slot, key)      a matcher at the start of grammar `key`, addressed by `slot`
  ("close", slot)
  STEP n_accept n_fill n_draft buffer rows words seq
                           accept tokens[i] on slots[i] for i < n_accept, then fill mask rows
                           fill_rows[i] of buffer `buffer` ([rows, words] bits) from fill_slots[i]
                           (with n_draft > 0: fill_ndraft[i] of the draft_tok, the rows after
                           fill_rows[i] get the masks after each: executor.run_job), then set
                           the buffer's fence word to `seq` (also when the step failed)
worker -> engine: ("ready",) once after start-up; DONE n_rejected seconds per step (the rejected
accept indices in shared memory; the job's time); ("error", text) when a step failed.
STEP and DONE, one each per step, are packed structs (`STEP`, `DONE`: their first byte is never a
pickle's), the rest pickled tuples.
On CUDA the GPU waits for the fence word before copying the masks (photon.worker.slots), so the
engine thread never waits for a fill; it reads "done" by its next commit. Everything the engine
sent before a step is handled first, and steps run in order.
"""

from __future__ import annotations

import argparse
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from photon.structured.bitmask import TokenMask, mask_numel, mask_views
from photon.structured.compile_pool import COMPILE_SLOTS, CompilePool, is_heavy
from photon.structured.executor import Handles, JobClock, StepJob, run_job
from photon.tokenizer import Tokenizer

ARRAYS = ("acc_slot", "acc_tok", "fill_row", "fill_slot", "fill_ndraft", "draft_tok", "rejected",
          "fence")
STEP = struct.Struct("<c7I")  # b"S", n_accept, n_fill, n_draft, buffer, rows, words, seq
DONE = struct.Struct("<cId")  # b"D", n_rejected, seconds


class SharedLayout:
    """Offsets (in int32 words) of the shared file: the row arrays (`fence` uses two words: one
    per mask buffer), then two mask buffers."""

    def __init__(self, max_rows: int, words: int) -> None:
        self.max_rows = max_rows
        self.mask_numel = mask_numel(max_rows, words)
        self.nbytes = 4 * (len(ARRAYS) * max_rows + 2 * self.mask_numel)

    def views(self, buf: Any) -> tuple[dict[str, np.ndarray], list[torch.Tensor]]:
        flat = torch.frombuffer(buf, dtype=torch.int32)
        arrays = {name: flat[i * self.max_rows:(i + 1) * self.max_rows].numpy()
                  for i, name in enumerate(ARRAYS)}
        start = len(ARRAYS) * self.max_rows
        masks = [flat[start + i * self.mask_numel:start + (i + 1) * self.mask_numel]
                 for i in range(2)]
        return arrays, masks

    @staticmethod
    def fences(arrays: dict[str, np.ndarray]) -> np.ndarray:
        """The two fence words (one per mask buffer), unsigned: job numbers wrap at 2**32."""
        return arrays["fence"][:2].view(np.uint32)


# ------------------------------------------------------------------------------ engine side
class ProcessExecutor:
    """The engine's end of one grammar-worker process (see photon.structured.executor)."""

    def __init__(self, tokenizer: Tokenizer, backend: str, vocab_size: int, threads: int,
                 max_rows: int, words: int, cuda: bool) -> None:
        self.layout = SharedLayout(max_rows, words)
        self.spin_s = SPIN_S if cuda else 0.0
        self.shared = SharedFile(self.layout, cuda)
        self.arrays, self._masks = self.shared.arrays, self.shared.masks
        self.fences = self.shared.fences
        self.fence_values = self.shared.fence_values  # one list: the finalizer releases them
        self._seq = 0
        # The tokenizer goes by file (pickled: its JSON), not by the socket: a send that large
        # would block until the worker finished importing. The model directory may be gone.
        init = tempfile.TemporaryFile()
        pickle.dump(tokenizer, init)
        init.seek(0)
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        self._readable = SocketPoll(self.conn)
        fds = (theirs.fileno(), self.shared.file.fileno(), init.fileno())
        cmd = [sys.executable, "-m", "photon.structured.worker", "--sock", str(fds[0]),
               "--mem", str(fds[1]), "--init", str(fds[2]), "--backend", backend,
               "--vocab-size", str(vocab_size), "--threads", str(threads),
               "--max-rows", str(max_rows), "--words", str(words),
               "--spin-us", str(int(1e6 * self.spin_s))]
        # A session of its own: a terminal's Ctrl-C must not interrupt it while it imports (it
        # ignores SIGINT only from then on); it ends when the engine closes its socket.
        self.proc = subprocess.Popen(cmd, pass_fds=fds, start_new_session=True)
        theirs.close()
        init.close()
        # An engine that is dropped without shutdown() still ends its worker (and unregisters
        # the shared file: see SharedFile.close).
        self._finalizer = weakref.finalize(self, _stop_worker, self.proc, self.conn, self.shared)
        self._send_lock = threading.Lock()  # compiles are announced from the server's thread too
        self._ready = False
        self.clock = JobClock()  # the worker's time in step jobs
        self._pending = 0
        self._handles = Handles()

    def _send(self, msg: tuple) -> None:
        self._send_bytes(pickle.dumps(msg))

    def _send_bytes(self, data: bytes) -> None:
        with self._send_lock:
            try:
                self.conn.send_bytes(data)
            except OSError as e:
                raise RuntimeError(f"the grammar worker died ({e})") from None

    def ready(self) -> bool:
        """Whether the worker finished starting (it imports xgrammar and builds its vocabulary
        tables: seconds); raises if it died."""
        if self._ready:
            return True
        if self.proc.poll() is not None:
            raise RuntimeError(f"the grammar worker exited with status {self.proc.returncode}")
        if self.conn.poll(0):
            self._expect("ready")
            self._ready = True
        return self._ready

    def _expect(self, kind: str) -> tuple:
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError):  # closed, or reset with our message unread
            raise RuntimeError("the grammar worker died") from None
        msg = ("done", *DONE.unpack(data)[1:]) if data[:1] == b"D" else pickle.loads(data)
        if msg[0] == "error":
            raise RuntimeError(f"grammar worker: {msg[1]}")
        assert msg[0] == kind, f"grammar worker sent {msg[0]!r}, expected {kind!r}"
        return msg

    def prepare(self, key: tuple, spec: Any) -> None:
        self._send(("compile", key, spec))

    def forget(self, key: tuple) -> None:
        self._send(("forget", key))

    def open(self, key: tuple, compiled: Any) -> int:
        handle = self._handles.take()
        self._send(("open", handle, key))
        return handle

    def close(self, handle: int) -> None:
        self._handles.give(handle)  # first: with the worker gone, the send raises
        self._send(("close", handle))

    @property
    def open_matchers(self) -> int:
        return self._handles.in_use

    def mask_buffer(self, index: int, numel: int) -> torch.Tensor:
        assert numel <= self.layout.mask_numel, "mask larger than the shared buffer"
        return self._masks[index]

    def submit(self, job: StepJob, mask: TokenMask | None, index: int) -> None:
        a = self.arrays
        n, m = job.acc_handles.size, job.fill_rows.size
        a["acc_slot"][:n], a["acc_tok"][:n] = job.acc_handles, job.acc_tokens
        a["fill_row"][:m], a["fill_slot"][:m] = job.fill_rows, job.fill_handles
        d = job.draft_tokens.size
        if d:
            a["fill_ndraft"][:m], a["draft_tok"][:d] = job.fill_drafts, job.draft_tokens
        rows, words = mask.bits.shape if mask is not None else (0, 0)
        seq = (self._seq + 1) & 0xFFFFFFFF
        self._send_bytes(STEP.pack(b"S", n, m, d, index, rows, words, seq))
        self._seq = self.fence_values[index] = seq
        self._pending += 1

    def device_fence(self, index: int) -> tuple[int, int] | None:
        if not self.shared.registered:
            return None
        return self.fences.ctypes.data + 4 * index, self.fence_values[index]

    def wait(self) -> list[int]:
        if not self._pending:
            return []
        self._pending -= 1
        self._readable.spin(self.spin_s)
        try:
            _, n, busy_s = self._expect("done")
        except RuntimeError:
            self.shared.release_fences()
            raise
        self.clock.add(busy_s)
        return self.arrays["rejected"][:n].tolist()

    def shutdown(self) -> None:
        with self._send_lock:
            self._finalizer()


class SharedFile:
    """The engine's mapping of the file shared with the worker: the step arrays, the fence
    words, the mask buffers; on CUDA page-locked and mapped into the device's address space."""

    def __init__(self, layout: SharedLayout, cuda: bool) -> None:
        self.file = os.fdopen(os.memfd_create("photon-grammar") if hasattr(os, "memfd_create")
                              else _unlinked_temp_fd(), "r+b", buffering=0)
        os.ftruncate(self.file.fileno(), layout.nbytes)
        self.mem = mmap.mmap(self.file.fileno(), layout.nbytes)
        self.arrays, self.masks = layout.views(self.mem)
        self.fences = SharedLayout.fences(self.arrays)
        self.fence_values = [0, 0]  # per mask buffer: the number of the last job that fills it
        self.registered = _cuda_register(self.arrays["acc_slot"], layout.nbytes) if cuda \
            else False

    def release_fences(self) -> None:
        """Set the fence words from this side: a GPU waiting for a worker that died (or is being
        stopped) must not wait forever. The masks are garbage then; their requests fail."""
        self.fences[:] = self.fence_values

    def close(self) -> None:
        """Release the fences and undo the registration while the file is still mapped: a
        registration outliving its mapping would make a later mapping at the same address fail
        to register (several engines in one process)."""
        self.release_fences()
        if self.registered:
            try:  # no copy may still read the file; at interpreter exit CUDA may be gone already
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaHostUnregister(self.arrays["acc_slot"].ctypes.data)
            except RuntimeError:
                pass
            self.registered = False


# With a GPU, both ends poll the socket for up to this long after the last message instead of
# sleeping in recv(), so neither pays a thread wake-up per step (a decode step is a few ms, so
# the next message usually comes within it). On CPU the cores are the forward's, so nobody spins.
SPIN_S = 0.05


class SocketPoll:
    """Whether a connection has something to read, one poll(2) per check: `Connection.poll`
    builds a selector on every call, and both ends check once a step (or spin on it)."""

    def __init__(self, conn: Connection) -> None:
        self._poll = select.poll()
        self._poll.register(conn.fileno(), select.POLLIN)  # EOF reports POLLHUP: readable

    def spin(self, limit_s: float) -> None:
        """Until readable, or for at most `limit_s` (then the caller blocks in recv)."""
        start = time.perf_counter()
        while not self._poll.poll(0) and time.perf_counter() - start < limit_s:
            pass


def _stop_worker(proc: subprocess.Popen, conn: Connection, shared: SharedFile) -> None:
    shared.release_fences()
    conn.close()  # the worker reads EOF and returns
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shared.close()


def _unlinked_temp_fd() -> int:
    f = tempfile.TemporaryFile()
    return os.dup(f.fileno())


CUDA_HOST_REGISTER_MAPPED = 2


def _cuda_register(head: np.ndarray, nbytes: int) -> bool:
    """Page-lock the shared file, mapped into the device's address space: the masks' H2D copies
    are asynchronous (torch treats the memory as pinned) and the GPU can wait on the fence words."""
    err = torch.cuda.cudart().cudaHostRegister(head.ctypes.data, nbytes,
                                               CUDA_HOST_REGISTER_MAPPED)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the grammar worker's shared memory failed ({err})")
    return True


# ------------------------------------------------------------------------------ worker side
class Worker:
    def __init__(self, ns: argparse.Namespace) -> None:
        from photon.structured.backend import create_backend

        self.conn = Connection(ns.sock)
        self._readable = SocketPoll(self.conn)
        layout = SharedLayout(ns.max_rows, ns.words)
        self._mem = mmap.mmap(ns.mem, layout.nbytes)
        self.arrays, self.masks = layout.views(self._mem)
        self.fences = SharedLayout.fences(self.arrays)
        with os.fdopen(ns.init, "rb") as f:
            tokenizer = pickle.load(f)  # written by this package's engine: trusted
        self.backend = create_backend(ns.backend, tokenizer, ns.vocab_size, ns.threads)
        self.spin_s = ns.spin_us / 1e6
        # The engine's cached grammars (it sends "forget" when its cache drops one); a matcher
        # keeps its own grammar alive until it is closed.
        self.compiles: dict[tuple, Future] = {}
        self.pool = CompilePool(COMPILE_SLOTS, "photon-worker-compile")
        self.matchers: dict[int, Any] = {}

    def serve(self) -> None:
        """Until the engine closes its end (or the connection breaks): then return quietly, with
        no compile waited for (the pool's threads are daemons)."""
        try:
            self.conn.send(("ready",))
            while True:
                self._readable.spin(self.spin_s)
                data = self.conn.recv_bytes()
                if data[:1] == b"S":
                    self.conn.send_bytes(self._step(*STEP.unpack(data)[1:]))
                else:
                    self._handle(pickle.loads(data))  # from this package's engine: trusted
        except (EOFError, OSError):
            pass  # the engine is gone (closed, or reset with our message unread)
        finally:
            self.pool.shutdown()

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "compile":
            key, spec = msg[1], msg[2]
            self.compiles[key] = self.pool.submit(partial(self.backend.compile, spec),
                                                  is_heavy(key))
        elif kind == "forget":
            fut = self.compiles.pop(msg[1], None)
            if fut is not None:  # still compiling (it timed out): its slot is freed
                self.pool.abandon(fut, RuntimeError("forgotten"))
        elif kind == "open":
            self.matchers[msg[1]] = self.backend.matcher(self.compiles[msg[2]].result())
        elif kind == "close":
            self.matchers.pop(msg[1], None)

    def _step(self, n: int, m: int, d: int, index: int, rows: int, words: int, seq: int
              ) -> bytes:
        try:
            return self._run_step(n, m, d, index, rows, words)
        finally:
            # After the masks (and the rejected indices): the GPU copies them once it sees this.
            self.fences[index] = seq

    def _run_step(self, n: int, m: int, d: int, index: int, rows: int, words: int) -> bytes:
        start = time.perf_counter()
        try:
            a = self.arrays
            job = StepJob(a["acc_slot"][:n], a["acc_tok"][:n], a["fill_row"][:m],
                          a["fill_slot"][:m], a["fill_ndraft"][:m if d else 0], a["draft_tok"][:d])
            bits = mask_views(self.masks[index], rows, words).bits
            rejected = run_job(self.backend, self.matchers, job, bits)
            a["rejected"][:len(rejected)] = rejected
            return DONE.pack(b"D", len(rejected), time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 - reported to the engine, which raises it
            return pickle.dumps(("error", f"{type(e).__name__}: {e}"))


def main() -> None:
    p = argparse.ArgumentParser(description="photon's grammar worker (started by the engine)")
    for name in ("sock", "mem", "init", "vocab-size", "threads", "max-rows", "words", "spin-us"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--backend", required=True)
    # Ctrl-C reaches the whole process group; the engine decides when this process ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    Worker(p.parse_args()).serve()
    # Exit now: an abandoned compile may still run in C++, and interpreter finalization would
    # wait for it. Nothing here needs cleaning up (the engine owns the shared memory).
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
