"""The training corpus: the Python standard library's own .py sources, in a fixed order.

Files are read in sorted order of their path relative to the stdlib root; third-party packages
(site-packages, dist-packages) and files that are not UTF-8 are skipped. A deterministic 5% of
the files (the smallest sha256 of their relative path) is held out for evaluation, so the split
does not depend on which other files exist.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

HELDOUT_FRACTION = 0.05
_EXCLUDED_DIRS = ("site-packages", "dist-packages")


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the corpus root, "/"-separated
    text: str


@dataclass(frozen=True)
class Corpus:
    root: str
    train: list[SourceFile]
    heldout: list[SourceFile]

    def all_files(self) -> list[SourceFile]:
        return sorted(self.train + self.heldout, key=lambda f: f.path)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_sources(root: str | None = None) -> Iterator[SourceFile]:
    """Every .py file under `root` (default: this Python's stdlib) in relative-path order."""
    root = os.path.abspath(root or stdlib_root())
    paths = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    rels = sorted(os.path.relpath(p, root).replace(os.sep, "/") for p in paths)
    for rel in rels:
        if any(part in _EXCLUDED_DIRS for part in rel.split("/")):
            continue
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                yield SourceFile(rel, f.read())
        except (OSError, UnicodeDecodeError):
            continue


def stdlib_texts(root: str | None = None) -> Iterator[str]:
    """The texts of `stdlib_sources(root)`."""
    return (source.text for source in stdlib_sources(root))


def _path_key(rel: str) -> str:
    return hashlib.sha256(rel.encode("utf-8")).hexdigest()


def split_corpus(files: list[SourceFile], root: str,
                 fraction: float = HELDOUT_FRACTION) -> Corpus:
    """Hold out ceil(fraction * n) files (at least one when there are two or more)."""
    n_held = min(len(files) - 1, max(1, math.ceil(fraction * len(files)))) if files else 0
    held = {f.path for f in sorted(files, key=lambda f: _path_key(f.path))[:max(n_held, 0)]}
    return Corpus(root=root, train=[f for f in files if f.path not in held],
                  heldout=[f for f in files if f.path in held])


def load_corpus(root: str | None = None) -> Corpus:
    root = os.path.abspath(root or stdlib_root())
    files = list(stdlib_sources(root))
    if len(files) < 2:
        raise ValueError(f"--stdlib {root!r} holds {len(files)} readable .py file(s); "
                         "the corpus needs at least 2 (one is held out)")
    return split_corpus(files, root)


def corpus_digest(files: list[SourceFile]) -> tuple[str, int]:
    """sha256 and byte count of the UTF-8 texts concatenated in relative-path order."""
    h = hashlib.sha256()
    size = 0
    for f in sorted(files, key=lambda f: f.path):
        data = f.text.encode("utf-8")
        h.update(data)
        size += len(data)
    return h.hexdigest(), size


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
