"""`prepare`: train the BPE on the corpus and write the tokenized train / held-out streams.

DIR gets tokenizer.json + tokenizer_config.json (photon-tiny's ChatML specials at the same ids),
train.npy and heldout.npy (np.uint16 token ids, each document followed by <|endoftext|>) and
manifest.json (the corpus and every file's sha256). Two runs on the same Python give
byte-identical files.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from photon.model.tiny import build_tokenizer, write_json, write_tokenizer_files
from photon.train.corpus import Corpus, SourceFile, corpus_digest, file_sha256, load_corpus

DEFAULT_VOCAB_SIZE = 8192
EOT = "<|endoftext|>"
TRAIN_FILE, HELDOUT_FILE, MANIFEST_FILE = "train.npy", "heldout.npy", "manifest.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Manifest:
    python_version: str
    stdlib: str  # the corpus root it was read from
    num_files: int
    num_train_files: int
    num_heldout_files: int
    corpus_bytes: int
    corpus_sha256: str  # every file's UTF-8 text concatenated in relative-path order
    train_bytes: int
    heldout_bytes: int
    vocab_size: int  # the tokenizer's, specials included (the model pads it)
    special_tokens: dict[str, int]
    train_tokens: int
    heldout_tokens: int
    tokenizer_sha256: str
    tokenizer_config_sha256: str
    train_sha256: str
    heldout_sha256: str
    heldout_files: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, data_dir: str) -> Manifest:
        path = os.path.join(data_dir, MANIFEST_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: run `python -m photon.train prepare "
                                    f"--out {data_dir}` first")
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))


def train_tokenizer(corpus: Corpus, out_dir: str,
                    vocab_size: int = DEFAULT_VOCAB_SIZE) -> tuple[Any, dict[str, int]]:
    """The BPE trained on the corpus's train split, its two files written into `out_dir`; and
    the special tokens' ids."""
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, (f.text for f in corpus.train))
    return tokenizer, write_tokenizer_files(tokenizer, out_dir)


def encode_files(tokenizer: Any, files: list[SourceFile], eot_id: int) -> np.ndarray:
    """The files' token ids as one stream, each file followed by `eot_id`."""
    encodings = tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    ids: list[int] = []
    for enc in encodings:
        ids.extend(enc.ids)
        ids.append(eot_id)
    return np.asarray(ids, dtype=np.uint16)


def _save_stream(out_dir: str, name: str, ids: np.ndarray) -> str:
    path = os.path.join(out_dir, name)
    np.save(path, ids, allow_pickle=False)
    return file_sha256(path)


def prepare(out_dir: str, vocab_size: int = DEFAULT_VOCAB_SIZE,
            stdlib: str | None = None) -> Manifest:
    """Build DIR from the corpus under `stdlib` (default: this Python's standard library)."""
    if not 260 <= vocab_size <= 65_535:
        raise ValueError(f"--vocab-size must be in [260, 65535] (uint16 token streams), "
                         f"got {vocab_size}")
    corpus = load_corpus(stdlib)
    tokenizer, special = train_tokenizer(corpus, out_dir, vocab_size)
    train = encode_files(tokenizer, corpus.train, special[EOT])
    heldout = encode_files(tokenizer, corpus.heldout, special[EOT])
    manifest = _manifest(out_dir, corpus, tokenizer.get_vocab_size(with_added_tokens=True),
                         special, train, heldout)
    write_json(out_dir, MANIFEST_FILE, asdict(manifest))
    return manifest


def _manifest(out_dir: str, corpus: Corpus, vocab_size: int, special: dict[str, int],
              train: np.ndarray, heldout: np.ndarray) -> Manifest:
    digest, size = corpus_digest(corpus.all_files())
    return Manifest(
        python_version=sys.version.split()[0], stdlib=corpus.root,
        num_files=len(corpus.train) + len(corpus.heldout), num_train_files=len(corpus.train),
        num_heldout_files=len(corpus.heldout), corpus_bytes=size, corpus_sha256=digest,
        train_bytes=corpus_digest(corpus.train)[1], heldout_bytes=corpus_digest(corpus.heldout)[1],
        vocab_size=vocab_size, special_tokens=special,
        train_tokens=int(train.size), heldout_tokens=int(heldout.size),
        tokenizer_sha256=file_sha256(os.path.join(out_dir, "tokenizer.json")),
        tokenizer_config_sha256=file_sha256(os.path.join(out_dir, "tokenizer_config.json")),
        train_sha256=_save_stream(out_dir, TRAIN_FILE, train),
        heldout_sha256=_save_stream(out_dir, HELDOUT_FILE, heldout),
        heldout_files=[f.path for f in corpus.heldout])


def load_stream(data_dir: str, name: str) -> np.ndarray:
    return np.load(os.path.join(data_dir, name), allow_pickle=False)
