"""Held-out loss / perplexity and the draft's greedy agreement with its target.

Both read fixed, non-overlapping windows of the held-out stream (deterministic) and compute in
float32 without autocast, so the figures are those of the saved weights as a float32 loader sees
them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

MAX_K = 5


@dataclass(frozen=True)
class HeldoutLoss:
    loss: float  # mean next-token cross-entropy in nats
    perplexity: float
    tokens: int  # predicted positions
    windows: int


def heldout_windows(stream: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of shape [n, T]: the stream cut into consecutive windows of T
    predictions (one shorter window when the stream is shorter than T + 1)."""
    if stream.size < 2:
        raise ValueError(f"the held-out stream has {stream.size} token(s); at least 2 needed")
    seq_len = min(seq_len, stream.size - 1)
    n = (stream.size - 1) // seq_len
    data = torch.from_numpy(stream.astype(np.int64))
    inputs = data[: n * seq_len].view(n, seq_len)
    targets = data[1 : n * seq_len + 1].view(n, seq_len)
    return inputs, targets


def _logits(model: torch.nn.Module, inputs: torch.Tensor, device: torch.device) -> torch.Tensor:
    return model(input_ids=inputs.to(device), use_cache=False).logits.float()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, stream: np.ndarray, seq_len: int,
                 device: torch.device, batch_size: int = 32) -> HeldoutLoss:
    inputs, targets = heldout_windows(stream, seq_len)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(0, inputs.shape[0], batch_size):
        logits = _logits(model, inputs[i : i + batch_size], device)
        total += F.cross_entropy(logits.flatten(0, 1), targets[i : i + batch_size].to(device)
                                 .flatten(), reduction="sum").double()
    loss = total.item() / targets.numel()
    return HeldoutLoss(loss=loss, perplexity=math.exp(loss), tokens=targets.numel(),
                       windows=inputs.shape[0])


@dataclass(frozen=True)
class Agreement:
    windows: int
    positions: int
    agreement: float  # fraction of positions where the draft's argmax equals the target's
    # K -> expected accepted draft tokens per step when K are proposed:
    accepted_independent: dict[int, float]  # sum_{i<=K} p^i, as if positions were independent
    accepted_measured: dict[int, float]  # from the runs of consecutive agreements


def _run_lengths(agree: torch.Tensor) -> torch.Tensor:
    """runs[b, t] = number of consecutive True from position t on."""
    runs = torch.zeros(agree.shape, dtype=torch.int64)
    nxt = torch.zeros(agree.shape[0], dtype=torch.int64)
    for t in range(agree.shape[1] - 1, -1, -1):
        nxt = agree[:, t].long() * (nxt + 1)
        runs[:, t] = nxt
    return runs


@torch.no_grad()
def agreement(target: torch.nn.Module, draft: torch.nn.Module, stream: np.ndarray,
              seq_len: int, windows: int, device: torch.device, batch_size: int = 16,
              max_k: int = MAX_K) -> Agreement:
    """Teacher-forced greedy agreement on `windows` held-out windows spread evenly over the
    stream; the measured acceptance at K is the mean of min(K, run of agreements from there) over
    the positions with max_k positions of look-ahead left in their window."""
    inputs, _ = heldout_windows(stream, seq_len)
    pick = np.unique(np.linspace(0, inputs.shape[0] - 1, min(windows, inputs.shape[0]))
                     .round().astype(np.int64))
    inputs = inputs[torch.from_numpy(pick)]
    masks = []
    for i in range(0, inputs.shape[0], batch_size):
        batch = inputs[i : i + batch_size]
        masks.append((_logits(target, batch, device).argmax(-1)
                      == _logits(draft, batch, device).argmax(-1)).cpu())
    agree = torch.cat(masks)
    p = agree.float().mean().item()
    runs = _run_lengths(agree)
    length = agree.shape[1]
    starts = runs[:, : max(1, length - max_k + 1)]  # the same positions for every K
    measured = {k: starts.clamp(max=k).float().mean().item() for k in range(1, max_k + 1)}
    independent = {k: sum(p**i for i in range(1, k + 1)) for k in range(1, max_k + 1)}
    return Agreement(windows=agree.shape[0], positions=agree.numel(), agreement=p,
                     accepted_independent=independent, accepted_measured=measured)
