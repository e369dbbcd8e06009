"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous range of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from photon.distributed.group import TPGroup
from photon.model.layers.linear import copy_into, new_param, tp_or_single


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous vocab range [vocab_start, vocab_end) in a shard of
    ceil(vocab_size / tp) rows; the rows past vocab_end (the last ranks' padding when tp does not
    divide the vocabulary) are zero. A tiny vocabulary can leave a last rank no rows at all."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp_or_single(tp)
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.vocab_size = vocab_size
        self.vocab_per_partition = -(-vocab_size // self.tp_size)
        self.vocab_start = min(self.tp_rank * self.vocab_per_partition, vocab_size)
        self.vocab_end = min(self.vocab_start + self.vocab_per_partition, vocab_size)
        self.weight = new_param(self.vocab_per_partition, hidden_size, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(loaded.shape)}, "
                f"expected vocab_size={self.vocab_size} rows")
        rows = self.vocab_end - self.vocab_start
        copy_into(param.data[:rows], loaded[self.vocab_start:self.vocab_end])
        param.data[rows:].zero_()  # padding rows of the last rank: their logits are cut off

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Tokens outside this rank's range embed to zero; the all-reduce sums the ranks.
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * in_range[..., None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharing VocabParallelEmbedding's layout (so it can be tied to it)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab_size]; with tp > 1 every rank gets the
        whole row (its vocabulary slice gathered with the others', in rank order), so sampling
        sees the same logits on every rank."""
        local = F.linear(hidden, self.weight)
        return self.tp.all_gather(local, dim=-1)[:, :self.vocab_size].float()
