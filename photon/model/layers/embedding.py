"""Vocabulary-parallel embedding and LM head (tp_size is 1 for now)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from photon.model.layers.linear import copy_into, new_param, tp_rank_and_size


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous vocab range [vocab_start, vocab_end)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.vocab_size = vocab_size
        self.vocab_per_partition = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.vocab_per_partition
        self.vocab_end = min(self.vocab_start + self.vocab_per_partition, vocab_size)
        self.weight = new_param(self.vocab_per_partition, hidden_size, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(loaded.shape)}, "
                f"expected vocab_size={self.vocab_size} rows")
        rows = self.vocab_end - self.vocab_start
        copy_into(param.data[:rows], loaded[self.vocab_start:self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Tokens outside this rank's range embed to zero; the all-reduce sums the ranks.
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * in_range[..., None].to(self.weight.dtype)
        torch.distributed.all_reduce(out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharing VocabParallelEmbedding's layout (so it can be tied to it)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab_size]."""
        if self.tp_size > 1:
            raise NotImplementedError("tensor-parallel logits gather is not implemented yet")
        return F.linear(hidden, self.weight)[:, :self.vocab_size].float()
