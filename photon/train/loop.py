"""`fit`'s training loop: AdamW, linear warm-up then cosine decay to 10%, grad clip 1.0, bf16
autocast on CUDA (float32 on CPU), random contiguous windows of the train stream, seeded.

With `eval_interval` > 0 the loop also evaluates every that many steps (and after the last) and
keeps the weights of the evaluation with the lowest loss: on a small corpus a long budget
overfits, and the weights that generalise best are not the last ones. Evaluations add to the
wall time of a seconds budget; the step count is fixed before any.

The budget is a step count or a number of seconds. The cosine schedule needs its length up front,
so with seconds the loop times a few steps after the first ones (which pay for start-up and
compilation), fixes the total step count from them and records it; re-running with
`--steps <that count>` repeats the schedule. The loop reads nothing back from the device except at
log lines and at that one calibration point.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

MIN_LR_RATIO = 0.1
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
CLIP_NORM = 1.0
CALIBRATION_START, CALIBRATION_END = 2, 12  # steps timed to turn seconds into a step count


@dataclass(frozen=True)
class FitSettings:
    seq_len: int
    batch_size: int
    lr: float
    warmup_steps: int
    seed: int = 0
    steps: int | None = None
    seconds: float | None = None
    log_interval: int = 50
    compile: bool = False
    eval_interval: int = 0  # evaluate every N steps and keep the best weights; 0: the last
    eval_windows: int = 32  # held-out windows each evaluation reads

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.seconds is None):
            raise ValueError("give exactly one budget: --steps N or --seconds S")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"--seconds must be > 0, got {self.seconds}")
        for name in ("seq_len", "batch_size", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.eval_interval < 0 or self.eval_windows < 1:
            raise ValueError(f"--eval-interval must be >= 0 and --eval-windows >= 1, got "
                             f"{self.eval_interval}, {self.eval_windows}")
        if not self.lr > 0 or self.warmup_steps < 0:
            raise ValueError(f"--lr must be > 0 and --warmup >= 0, got {self.lr}, "
                             f"{self.warmup_steps}")


@dataclass
class FitResult:
    steps: int
    tokens_seen: int
    elapsed_seconds: float
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean since last log)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, evaluation loss)
    selected_step: int | None = None  # the step whose weights the model holds (None: the last)


class BestWeights:
    """The weights of the evaluation with the lowest loss so far (a copy on the model's
    device), put back into the model at the end."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.loss = math.inf
        self.state: dict[str, torch.Tensor] | None = None

    def offer(self, model: torch.nn.Module, step: int, loss: float) -> bool:
        if not loss < self.loss:
            return False
        self.step, self.loss = step, loss
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return True

    def restore(self, model: torch.nn.Module) -> None:
        if self.state is not None:
            model.load_state_dict(self.state)


def lr_at(step: int, settings: FitSettings, total: int | None) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr down to MIN_LR_RATIO * lr at
    `total` (peak lr while the total is not known yet)."""
    peak = settings.lr
    if step < settings.warmup_steps:
        return peak * (step + 1) / settings.warmup_steps
    if total is None:
        return peak
    span = max(1, total - settings.warmup_steps)
    progress = min(1.0, (step - settings.warmup_steps) / span)
    return peak * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, lr: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms); the fused kernel on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=1e-8,
                             fused=device.type == "cuda")


class WindowSampler:
    """Random contiguous (input, target) windows of the stream, drawn on the device."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int,
                 device: torch.device) -> None:
        if stream.size < seq_len + 2:
            raise ValueError(f"the train stream has {stream.size} tokens, fewer than "
                             f"--seq-len + 2 = {seq_len + 2}")
        self.data = torch.from_numpy(stream.astype(np.int64)).to(device)
        self.offsets = torch.arange(seq_len + 1, device=device)
        self.batch_size = batch_size
        self.high = stream.size - seq_len - 1
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.high + 1, (self.batch_size,), generator=self.gen,
                               device=self.data.device)
        window = self.data[starts[:, None] + self.offsets]
        return window[:, :-1], window[:, 1:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _total_from_time(step: int, t_start: float, t_calib: float, seconds: float,
                     device: torch.device) -> int:
    _sync(device)
    now = time.perf_counter()
    per_step = (now - t_calib) / (CALIBRATION_END - CALIBRATION_START)
    return max(step, step + int((seconds - (now - t_start)) / per_step))


def train(model: torch.nn.Module, stream: np.ndarray, settings: FitSettings,
          device: torch.device, log: Callable[[str], None] = print,
          evaluate: Callable[[torch.nn.Module], float] | None = None) -> FitResult:
    """Train `model` (already on `device`, float32) in place; returns what happened.
    `evaluate(model)` (the model in eval mode): the loss `settings.eval_interval` selects by."""
    best = BestWeights() if evaluate is not None and settings.eval_interval else None
    sampler = WindowSampler(stream, settings.seq_len, settings.batch_size, settings.seed, device)
    optimizer = make_optimizer(model, settings.lr, device)
    step_fn = torch.compile(model) if settings.compile else model
    model.train()
    total = settings.steps
    result = FitResult(steps=0, tokens_seen=0, elapsed_seconds=0.0)
    loss_sum = torch.zeros((), device=device)
    t_start = t_log = t_calib = time.perf_counter()
    step = last_log = 0
    while total is None or step < total:
        lr = lr_at(step, settings, total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum += _step(step_fn, model, optimizer, sampler, device)
        step += 1
        if total is None and step == CALIBRATION_START:
            _sync(device)
            t_calib = time.perf_counter()
            if t_calib - t_start >= (settings.seconds or 0.0):
                total = step  # the first steps alone used up the budget
        elif total is None and step == CALIBRATION_END:
            total = _total_from_time(step, t_start, t_calib, settings.seconds or 0.0, device)
            log(f"timed steps {CALIBRATION_START}-{CALIBRATION_END}: {total} steps fit in "
                f"{settings.seconds:g}s")
        if step % settings.log_interval == 0 or step == total:
            mean = loss_sum.item() / (step - last_log)  # the only regular host sync
            now = time.perf_counter()
            tps = (step - last_log) * settings.batch_size * settings.seq_len / (now - t_log)
            log(f"step {step}/{total if total is not None else '?'} loss {mean:.4f} "
                f"lr {lr:.2e} tokens/s {tps:,.0f} elapsed {now - t_start:.1f}s")
            result.losses.append((step, mean))
            loss_sum.zero_()
            t_log, last_log = now, step
        if best is not None and (step % settings.eval_interval == 0 or step == total):
            _evaluate(model, step, evaluate, best, result, log)
    _sync(device)
    model.eval()
    if best is not None:
        best.restore(model)
        result.selected_step = best.step
        log(f"kept the weights of step {best.step} (evaluation loss {best.loss:.4f})")
    result.steps = step
    result.tokens_seen = step * settings.batch_size * settings.seq_len
    result.elapsed_seconds = time.perf_counter() - t_start
    return result


def _evaluate(model: torch.nn.Module, step: int, evaluate: Callable[[torch.nn.Module], float],
              best: BestWeights, result: FitResult, log: Callable[[str], None]) -> None:
    model.eval()
    loss = evaluate(model)
    model.train()
    result.evals.append((step, loss))
    kept = best.offer(model, step, loss)
    log(f"step {step} evaluation loss {loss:.4f}" + (" (best so far)" if kept else ""))


def _step(step_fn: Callable[..., object], model: torch.nn.Module,
          optimizer: torch.optim.Optimizer, sampler: WindowSampler,
          device: torch.device) -> torch.Tensor:
    inputs, targets = sampler.next()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = step_fn(input_ids=inputs, use_cache=False).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
