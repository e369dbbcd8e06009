"""Prompts of `photon bench spec`: held-out Python code from a prepared data directory, or random ids.

`heldout_code_prompts(data_dir, count, length, model_dir)` cuts `count` windows of `length` tokens
from the held-out stream of a `python -m photon.train prepare` directory, evenly spread over it
(so B prompts come from many files). The ids are the data's tokenizer's; when the model was
trained on another tokenizer (its `photon_training.tokenizer_sha256` differs from the data's, or
it has none), each window is decoded to text and re-encoded with the model's tokenizer, then cut
to `length` tokens. Random prompts are seeded token ids below the vocabulary size.
"""

from __future__ import annotations

import os
import random

from photon.model.hf_config import load_hf_config


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def trained_tokenizer_sha(model_dir: str) -> str | None:
    """The tokenizer sha256 a photon-trained model records, or None (not photon-trained)."""
    record = load_hf_config(model_dir).get("photon_training")
    return record.get("tokenizer_sha256") if isinstance(record, dict) else None


def _windows(stream: list[int], count: int, length: int) -> list[list[int]]:
    if len(stream) < length:
        raise ValueError(f"the held-out stream has {len(stream)} tokens; prompts of {length} "
                         f"tokens were asked for")
    span = len(stream) - length
    starts = [i * span // (count - 1) for i in range(count)] if count > 1 else [0]
    return [stream[s:s + length] for s in starts]


def heldout_code_prompts(data_dir: str, count: int, length: int,
                         model_dir: str) -> list[list[int]]:
    """`count` prompts of `length` tokens of held-out code (see the module doc)."""
    from photon.train.tokenizer import HELDOUT_FILE, Manifest, load_stream

    if count < 1 or length < 1:
        raise ValueError(f"need at least one prompt of at least one token, got {count} x {length}")
    manifest = Manifest.read(data_dir)
    stream = load_stream(data_dir, HELDOUT_FILE).astype("int64").tolist()
    if trained_tokenizer_sha(model_dir) == manifest.tokenizer_sha256:
        return _windows(stream, count, length)
    # Another tokenizer: take text windows twice as long (BPEs differ), re-encode, cut.
    from tokenizers import Tokenizer

    source = Tokenizer.from_file(os.path.join(data_dir, "tokenizer.json"))
    target = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    prompts = []
    for window in _windows(stream, count, min(len(stream), 2 * length)):
        ids = target.encode(source.decode(window), add_special_tokens=False).ids[:length]
        if len(ids) < length:
            raise ValueError(f"{data_dir}: a held-out window re-encodes to {len(ids)} tokens of "
                             f"{model_dir}'s tokenizer, fewer than {length}")
        prompts.append(ids)
    return prompts
