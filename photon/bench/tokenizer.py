"""A benchmark tokenizer with a realistic vocabulary for the large built-in shapes.

photon-tiny's 1,000-token tokenizer on a 151,936-wide model makes every sampled id past 1,000
detokenize to nothing and gives grammar backends a toy vocabulary, so host costs that scale with
the vocabulary (detokenization, grammar masks) would be understated. This one is a byte-level BPE
(ChatML specials at ids 0-2, like photon-tiny) trained with the same code on the running Python's
standard-library sources: ~31 MB of code, docstrings and prose, giving ~120k tokens when asked for
Qwen's 151,643 (the trainer stops when the corpus has no pair left to merge). Nothing is
downloaded; it is built once (seconds) into `$PHOTON_CACHE_DIR`, one directory per Python version
because the corpus is that version's standard library.
"""

from __future__ import annotations

import sys

from photon.model.tiny import build_tokenizer, ensure_generated, write_tokenizer_files
from photon.train.corpus import stdlib_texts

TARGET_VOCAB = 151_643
_FILES = ("tokenizer.json", "tokenizer_config.json")


def _dir_name() -> str:
    return f"photon-bench-bpe-v1-py{sys.version_info.major}{sys.version_info.minor}"


def write_bench_tokenizer(out_dir: str) -> None:
    write_tokenizer_files(build_tokenizer(TARGET_VOCAB, stdlib_texts()), out_dir)


def ensure_bench_tokenizer(cache_dir: str | None = None) -> str:
    """Directory holding the benchmark tokenizer's two files (built on first use)."""
    return ensure_generated(_dir_name(), _FILES, write_bench_tokenizer, cache_dir)
