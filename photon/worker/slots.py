"""Ping-pong step slots and the stream/event fences of the pipeline.

Step t (the plan's step number) uses slot S[t % 2]: pinned host staging buffers and device buffers at fixed addresses,
allocated once. All per-step integers travel in one packed int64 buffer and all floats in one packed
float32 buffer, so a launch costs two H2D copies however many fields a step has.

Fences (CUDA; on CPU every copy is synchronous and every fence a no-op):
  prepare(t):   the host fills S.host_*
  launch(t):    copy stream: H2D S.host_* -> S.dev_*, record S.h2d_done; compute stream waits
                S.h2d_done, then runs the forward reading S.dev_*
  sample(t):    compute stream samples, writes tokens into the token pool and S.dev_out,
                records S.sampled; copy stream waits S.sampled, D2H S.dev_out -> S.host_out,
                records S.copy_done
  commit(t):    the host waits S.copy_done: the only host sync of an iteration
Grammar masks (only in steps where some sampling row has a grammar):
  commit(t-1):  the grammar job (accepts of t-1, then the fill of mask buffer S) is submitted; the
                buffer is page-locked host memory: pinned, or the grammar worker's shared memory
                registered with CUDA
  sample(t):    mask stream: [wait until the worker's fence word for S reaches the job's number
                (cuStreamWaitValue32: the GPU waits, not the engine thread)], H2D mask buffer S
                -> S.mask_dev, record S.mask_ready; compute stream waits S.mask_ready before
                sampling. Without a device wait (CPU, inline jobs, `--structured-outputs-mask-wait
                host`) the host waits for the job before this H2D instead. The worker writes the
                fence word after the masks and jobs finish in order, so a word at or past the
                job's number means this job's masks are in S; the job was submitted after
                commit(t-2) waited for the sampling that read S's previous masks.
                Both buffers are free again at t+2 for the same reason as S.dev_*: commit(t)
                waited S.copy_done, recorded after S.sampled, which followed S.mask_ready.
Reuse of S at t+2 is safe: commit(t) waited S.copy_done, which the copy stream recorded after the
H2D of step t and after the compute stream's S.sampled (so forward t no longer reads S.dev_*).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from photon.structured.bitmask import TokenMask
from photon.worker.stream_wait import HostWordWait


def _no_stream() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


class Streams:
    """The compute, copy and mask streams of one device (None on CPU: everything runs in order).
    Masks get their own stream: its device wait for the grammar worker must never hold up the
    copy stream's D2H of sampled tokens or H2D of step inputs."""

    def __init__(self, device: torch.device, device_waits: bool = False) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self.copy = torch.cuda.Stream(device) if self.cuda else None
        self.mask = torch.cuda.Stream(device) if self.cuda else None
        # Whether the mask stream can wait for a host word on the device (see module docstring).
        self.word_wait = HostWordWait.create(device) if device_waits else None

    def event(self) -> torch.cuda.Event | None:
        return torch.cuda.Event() if self.cuda else None


@dataclass
class OutputViews:
    """Device views of a step's outputs: sampled tokens (or, for prompt logprobs, the prompt
    tokens scored) with their logprobs, ranks and top-K alternatives."""

    tokens: torch.Tensor  # [R] int64
    logprob: torch.Tensor  # [R] float32
    ranks: torch.Tensor  # [R] int64
    topk_ids: torch.Tensor  # [R, K] int64
    topk_lp: torch.Tensor  # [R, K] float32


class OutputBuffer:
    """A device output buffer and its host twin (pinned on CUDA), grown on demand."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        self.dev = torch.zeros(numel, dtype=dtype, device=device)
        self.host = torch.zeros(numel, dtype=dtype, pin_memory=device.type == "cuda")

    def ensure(self, numel: int) -> None:
        """Only between uses: the slot's previous step was committed (its copy waited)."""
        if numel > self.dev.numel():
            self.__init__(max(numel, 2 * self.dev.numel()), self.dev.dtype, self.device)

    def enqueue_download(self, numel: int, cuda: bool) -> None:
        if numel:
            self.host[:numel].copy_(self.dev[:numel], non_blocking=cuda)


def _views(ints: torch.Tensor, floats: torch.Tensor, rows: int, k: int,
           tokens: torch.Tensor) -> OutputViews:
    """[ranks R | topk ids R*K] from `ints` past `tokens`, [logprob R | topk R*K] in floats."""
    return OutputViews(tokens, floats[:rows], ints[:rows],
                       ints[rows:rows + rows * k].view(rows, k),
                       floats[rows:rows + rows * k].view(rows, k))


class PackedBuffer:
    """A host staging buffer and its device twin; fields are packed back to back each step."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> None:
        self.host = torch.zeros(numel, dtype=dtype, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(numel, dtype=dtype, device=device) if device.type != "cpu" else None
        self.used = 0

    def grow_if_needed(self, numel: int, device: torch.device, pin: bool) -> None:
        if numel > self.host.numel():
            self.__init__(max(numel, 2 * self.host.numel()), self.host.dtype, device, pin)

    def pack(self, arrays: list[np.ndarray]) -> list[tuple[int, int]]:
        """Write arrays into the host buffer; return (offset, length) of each."""
        spans, off = [], 0
        for arr in arrays:
            n = arr.size
            self.host_np[off:off + n] = arr.reshape(-1)
            spans.append((off, n))
            off += n
        self.used = off
        return spans

    def device_view(self) -> torch.Tensor:
        return self.host if self.dev is None else self.dev

    def copy_to_device(self) -> None:
        if self.dev is not None and self.used:
            self.dev[: self.used].copy_(self.host[: self.used], non_blocking=True)


class StepSlot:
    def __init__(self, index: int, device: torch.device, max_rows: int, max_logprobs: int,
                 int_numel: int, float_numel: int, mask_numel: int = 0) -> None:
        pin = device.type == "cuda"
        self.index = index
        self.device = device
        self.pin = pin
        self.ints = PackedBuffer(int_numel, torch.int64, device, pin)
        self.floats = PackedBuffer(float_numel, torch.float32, device, pin)
        k = max_logprobs
        # Output: [tokens | ranks | topk ids] as int64 and [logprob | topk logprobs] as float32.
        self.out_i_dev = torch.zeros(max_rows * (2 + k), dtype=torch.int64, device=device)
        self.out_f_dev = torch.zeros(max_rows * (1 + k), dtype=torch.float32, device=device)
        self.out_i_host = torch.zeros_like(self.out_i_dev, device="cpu", pin_memory=pin)
        self.out_f_host = torch.zeros_like(self.out_f_dev, device="cpu", pin_memory=pin)
        # Prompt logprobs: [ranks | topk ids] and [logprobs | topk logprobs] of the prompt
        # positions scored this step (`prompt_used` P x (1 + K); 0 in most steps).
        self.prompt_i = OutputBuffer(0, torch.int64, device)
        self.prompt_f = OutputBuffer(0, torch.float32, device)
        self.prompt_used = 0
        # A step's packed next-token masks, flat int32 (layout: photon.structured.bitmask); their
        # host side is the grammar executor's buffer for this slot.
        self.mask_dev = torch.zeros(mask_numel, dtype=torch.int32, device=device) if pin else None
        self.mask_ready = torch.cuda.Event() if pin else None
        self.h2d_done = torch.cuda.Event() if pin else None
        self.sampled = torch.cuda.Event() if pin else None
        self.copy_done = torch.cuda.Event() if pin else None

    def stage(self, ints: list[np.ndarray], floats: list[np.ndarray]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Pack host arrays; return device views (valid on the compute stream after `upload`)."""
        self.ints.grow_if_needed(sum(a.size for a in ints), self.device, self.pin)
        self.floats.grow_if_needed(sum(a.size for a in floats), self.device, self.pin)
        int_spans = self.ints.pack(ints)
        float_spans = self.floats.pack(floats)
        iv, fv = self.ints.device_view(), self.floats.device_view()
        return ([iv[o:o + n] for o, n in int_spans], [fv[o:o + n] for o, n in float_spans])

    def upload(self, streams: Streams) -> None:
        if streams.cuda:
            with torch.cuda.stream(streams.copy):
                self.ints.copy_to_device()
                self.floats.copy_to_device()
                self.h2d_done.record()
            streams.compute.wait_event(self.h2d_done)

    def upload_mask(self, streams: Streams, mask: TokenMask,
                    fence: tuple[int, int] | None = None) -> torch.Tensor:
        """H2D of `mask.flat` (page-locked host memory) on the mask stream, fenced for the compute
        stream; with `fence` (host address of a word, value), only once the word reaches the
        value (the wait and the copy go straight to the driver: this runs every grammar step on
        the engine thread). On CPU, `mask.flat` itself."""
        host = mask.flat
        if not streams.cuda:
            return host
        numel = host.numel()
        if fence is not None:
            streams.word_wait.copy_after(streams.mask, *fence, self.mask_dev.data_ptr(),
                                         host.data_ptr(), 4 * numel)
        else:
            with torch.cuda.stream(streams.mask):
                self.mask_dev[:numel].copy_(host, non_blocking=True)
        self.mask_ready.record(streams.mask)
        streams.compute.wait_event(self.mask_ready)
        return self.mask_dev

    def output_views(self, rows: int, k: int, host: bool = False) -> OutputViews:
        i, f = (self.out_i_host, self.out_f_host) if host else (self.out_i_dev, self.out_f_dev)
        return _views(i[rows:], f, rows, k, i[:rows])

    def prompt_views(self, positions: int, k: int, host: bool = False) -> OutputViews:
        """Views of the prompt logprob outputs (`tokens` is unused: the host knows them)."""
        i = self.prompt_i.host if host else self.prompt_i.dev
        f = self.prompt_f.host if host else self.prompt_f.dev
        return _views(i, f, positions, k, i[:0])

    def reserve_prompt(self, positions: int, k: int) -> None:
        """This step scores `positions` prompt positions with top-`k` (0 positions: none)."""
        self.prompt_used = positions * (1 + k)
        self.prompt_i.ensure(self.prompt_used)
        self.prompt_f.ensure(self.prompt_used)

    def download(self, streams: Streams, rows: int, k: int) -> None:
        """Enqueue the D2H copy of the sampled tokens (and logprobs, ranks, prompt logprobs)
        after sampling finished."""
        n_i = rows * (2 + k) if k >= 0 else rows
        n_f = rows * (1 + k) if k >= 0 else 0
        if streams.cuda:
            self.sampled.record(streams.compute)
        with torch.cuda.stream(streams.copy) if streams.cuda else _no_stream():
            if streams.cuda:
                streams.copy.wait_event(self.sampled)
            if n_i:
                self.out_i_host[:n_i].copy_(self.out_i_dev[:n_i], non_blocking=streams.cuda)
            if n_f:
                self.out_f_host[:n_f].copy_(self.out_f_dev[:n_f], non_blocking=streams.cuda)
            self.prompt_i.enqueue_download(self.prompt_used, streams.cuda)
            self.prompt_f.enqueue_download(self.prompt_used, streams.cuda)
            if streams.cuda:
                self.copy_done.record()

    def wait(self) -> None:
        """commit(t)'s wait: the designated host sync of the pipeline."""
        if self.copy_done is not None:
            self.copy_done.synchronize()
