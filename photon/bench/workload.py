"""The standard offline workload (the "nano-vllm bench" workload: random token-id prompts).

Python's `random` seeded with `seed` (a private `random.Random(seed)`: the same sequence as
`random.seed(seed)` without touching the global state), in exactly this order: for each prompt
its length `randint(*input_len_range)` and, right after it, that many token ids
`randint(0, vocab_limit)`; then every output length `randint(*output_len_range)`.
The defaults give 256 requests with 142,827 prompt and 133,966 output tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

Workload = list[tuple[list[int], int]]  # (prompt token ids, output length) per request


def standard_workload(
    num_prompts: int = 256,
    input_len_range: tuple[int, int] = (100, 1024),
    output_len_range: tuple[int, int] = (100, 1024),
    seed: int = 0,
    vocab_limit: int = 10000,
) -> Workload:
    """Requests of the standard workload; ranges and token ids are inclusive (`randint`)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        length = rng.randint(*input_len_range)
        prompts.append([rng.randint(0, vocab_limit) for _ in range(length)])
    output_lens = [rng.randint(*output_len_range) for _ in range(num_prompts)]
    return list(zip(prompts, output_lens))


def fit_vocab(workload: Workload, vocab_size: int) -> Workload:
    """Fold token ids into [0, vocab_size) for small vocabularies; lengths are unchanged.

    Drawing with a smaller `vocab_limit` instead would consume `random` differently and change the
    lengths, so the ids are folded after the draw.
    """
    return [([t % vocab_size for t in ids], out) for ids, out in workload]


def totals(workload: Sequence[tuple[Sequence[int], int]]) -> tuple[int, int]:
    """(prompt tokens, output tokens) of a workload."""
    return sum(len(ids) for ids, _ in workload), sum(out for _, out in workload)
