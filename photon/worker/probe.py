"""StepProbe: optional per-step timing for `photon bench bubble` (off in normal runs).

GPU time of a step = (forward end - forward start) + (sampling end - sampling start), from CUDA
events on the compute stream; host time = wall time of an iteration minus its commit wait.
On CPU the "GPU" spans are wall-clock spans of the same regions (forward and sampling run inline).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class StepMarks:
    marks: dict[str, torch.cuda.Event | float] = field(default_factory=dict)


class StepProbe:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.steps: list[StepMarks] = []
        self.wait_s = 0.0

    def new_step(self) -> StepMarks:
        marks = StepMarks()
        self.steps.append(marks)
        return marks

    def mark(self, step: StepMarks, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            step.marks[name] = event
        else:
            step.marks[name] = time.perf_counter()

    def reset(self) -> None:
        self.steps.clear()
        self.wait_s = 0.0

    def gpu_seconds(self) -> float:
        """Sum over recorded steps of forward + sampling time (call after a synchronize)."""
        total = 0.0
        for step in self.steps:
            m = step.marks
            for a, b in (("fwd_start", "fwd_end"), ("smp_start", "smp_end")):
                if a in m and b in m:
                    total += _elapsed(m[a], m[b])
        return total


def _elapsed(a: torch.cuda.Event | float, b: torch.cuda.Event | float) -> float:
    if isinstance(a, float):
        return float(b) - a
    return a.elapsed_time(b) / 1000.0
