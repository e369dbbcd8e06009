"""A CUDA stream that waits, on the device, until a page-locked host word reaches a value.

The driver's stream memory operation `cuStreamWaitValue32` holds every later operation of one
stream until `(int32)(*word - value) >= 0`, without occupying an SM and without a host thread. The
grammar worker writes such a word after each step's mask fill, so the mask's H2D copy (and through
its event, the sampling) waits for the worker on the GPU: the engine thread never waits for the
fill (photon.worker.slots documents the fences).

Reached through ctypes (PyTorch does not expose it); `HostWordWait.create` returns None where the
driver or the device lacks it, and callers then wait on the host instead.
"""

from __future__ import annotations

import ctypes
import platform

import torch

CU_STREAM_WAIT_VALUE_GEQ = 0x0  # wrap-safe: (int32)(*addr - value) >= 0
CUDA_SUCCESS = 0
CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # CUdevice_attribute


class HostWordWait:
    def __init__(self, lib: ctypes.CDLL, device: torch.device) -> None:
        self.device = device
        self._lib = lib
        self._wait = lib.cuStreamWaitValue32_v2
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._wait.restype = ctypes.c_int
        self._copy = lib.cuMemcpyHtoDAsync_v2
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self._copy.restype = ctypes.c_int
        self._same_address = self._attribute(CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM) == 1
        self._pointers: dict[int, int] = {}

    @classmethod
    def create(cls, device: torch.device) -> HostWordWait | None:
        """The driver's entry points, or None (not Linux, an old driver, no CUDA device, or a
        host whose stores another agent may see out of order: the worker writes the masks, then
        the word, with plain stores, which x86-64 keeps in order and weaker-ordered CPUs such as
        aarch64 need barriers for)."""
        if device.type != "cuda" or platform.machine().lower() not in ("x86_64", "amd64"):
            return None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            return cls(lib, device)
        except (OSError, AttributeError, RuntimeError):
            return None

    def _check(self, rc: int, what: str) -> None:
        if rc != CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed (CUresult {rc})")

    def _attribute(self, attribute: int) -> int:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        dev, value = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        self._check(self._lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev),
                    "cuDeviceGetAttribute")
        return value.value

    def device_pointer(self, host_ptr: int) -> int:
        """The device address of a word inside host memory registered with CUDA (mapped): the
        host address itself where the device supports that (it does on x86-64 Linux)."""
        if self._same_address:
            return host_ptr
        ptr = self._pointers.get(host_ptr)
        if ptr is None:  # called on the engine thread, whose CUDA context is current
            out = ctypes.c_uint64()
            self._check(self._lib.cuMemHostGetDevicePointer_v2(
                ctypes.byref(out), ctypes.c_void_p(host_ptr), 0), "cuMemHostGetDevicePointer")
            ptr = self._pointers[host_ptr] = out.value
        return ptr

    def enqueue(self, stream: torch.cuda.Stream, host_ptr: int, value: int) -> None:
        """Everything enqueued on `stream` after this waits until the word at `host_ptr` (int32,
        page-locked) reaches `value` (modulo 2**32, wrap-safe)."""
        self._check(self._wait(ctypes.c_void_p(stream.cuda_stream), self.device_pointer(host_ptr),
                               value & 0xFFFFFFFF, CU_STREAM_WAIT_VALUE_GEQ),
                    "cuStreamWaitValue32")

    def copy_after(self, stream: torch.cuda.Stream, host_ptr: int, value: int, dst_ptr: int,
                   src_ptr: int, nbytes: int) -> None:
        """`enqueue` the wait, then an H2D copy of `nbytes` from page-locked `src_ptr` to device
        `dst_ptr` on the same stream: the driver's calls directly, without switching torch's
        current stream (that costs more host time than the copy itself)."""
        self.enqueue(stream, host_ptr, value)
        self._check(self._copy(dst_ptr, ctypes.c_void_p(src_ptr), nbytes,
                               ctypes.c_void_p(stream.cuda_stream)), "cuMemcpyHtoDAsync")
