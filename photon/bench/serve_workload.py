"""Requests for `photon bench serve`: random token-id prompts, a JSONL dataset, or the standard one.

Random: input and output lengths uniform (integers) in [len * (1 - r), len * (1 + r)], token ids
uniform in [0, vocab_size). Dataset: JSONL rows `{"prompt": str | [ids], "output_len": int}`
(optional `"prompt_len"`), cycled when there are fewer rows than requests. `standard`: the offline
"nano-vllm bench" workload of photon/bench/workload.py, ids folded into the vocabulary.
The chat endpoint needs text: token-id prompts are sized to their length after the chat template
(photon/bench/serve_tokenizer.py); with no tokenizer to do that (a server without /tokenize), they
become one common word per id (the server's usage then reports the real prompt length).
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any

from photon.bench.workload import fit_vocab, standard_workload

STANDARD_DATASET = "standard"
COMMON_WORDS = ("the of and to in is it you that he was for on are with as his they be at one "
                "have this from or had by word but what some we can out other were all there "
                "when up use your how said an each she which do their time if will way about "
                "many then them write would like so these her long make thing see him two has "
                "look more day").split()


@dataclass
class RequestSpec:
    prompt: str | list[int]
    output_len: int
    prompt_len: int | None = None  # known for token ids; else from the server's usage
    messages: list[dict[str, str]] | None = None  # a whole chat (the chat endpoint sends it)


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive integer bounds of [length * (1 - r), length * (1 + r)], at least 1."""
    if length < 1 or not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"need length >= 1 and 0 <= range ratio < 1, got {length}, {range_ratio}")
    lo = max(1, math.ceil(length * (1.0 - range_ratio)))
    hi = max(lo, math.floor(length * (1.0 + range_ratio)))
    return lo, hi


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_size: int, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    specs = []
    for _ in range(num):
        n_in = rng.randint(in_lo, in_hi)
        ids = [rng.randrange(vocab_size) for _ in range(n_in)]
        specs.append(RequestSpec(ids, rng.randint(out_lo, out_hi), n_in))
    return specs


def standard_requests(num: int | None, vocab_size: int, seed: int) -> list[RequestSpec]:
    workload = fit_vocab(standard_workload(num or 256, seed=seed), vocab_size)
    return [RequestSpec(ids, out, len(ids)) for ids, out in workload]


def _spec_from_row(row: dict[str, Any], where: str) -> RequestSpec:
    prompt, out = row.get("prompt"), row.get("output_len")
    ids_ok = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids_ok:
        raise ValueError(f"{where}: 'prompt' must be a non-empty string or list of token ids")
    if not isinstance(out, int) or out < 1:
        raise ValueError(f"{where}: 'output_len' must be a positive integer, got {out!r}")
    prompt_len = row.get("prompt_len", len(prompt) if isinstance(prompt, list) else None)
    return RequestSpec(prompt, out, prompt_len)


def load_dataset(path: str, num: int | None) -> list[RequestSpec]:
    """Rows of a JSONL file; `num` of them (cycling), or all when `num` is None."""
    if not os.path.isfile(path):
        raise ValueError(f"--dataset: no such file: {path}")
    specs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                specs.append(_spec_from_row(json.loads(line), f"{path}:{lineno}"))
    if not specs:
        raise ValueError(f"{path}: no requests")
    if num is None:
        return specs
    return [specs[i % len(specs)] for i in range(num)]


def ids_to_text(ids: list[int]) -> str:
    """A stand-in text prompt of len(ids) common words (for the chat endpoint)."""
    return " ".join(COMMON_WORDS[t % len(COMMON_WORDS)] for t in ids)
