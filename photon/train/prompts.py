"""Prompts of held-out code for parity tests: token prefixes of the held-out files.

`heldout_prompts(data_dir)` reads a `prepare` directory: the held-out files (manifest order) and
their token ids (`heldout.npy`, each file followed by `<|endoftext|>`). The first `count` files
with at least `max_tokens` tokens each give one prompt: its first N tokens, N between
`min_tokens` and `max_tokens` chosen by the sha256 of the file's path. The same prepared data
always gives the same prompts. `cut_prompts` cuts them from a held-out stream in memory.

    python -m photon.train.prompts --data DIR --out FILE.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from photon.train.tokenizer import EOT, HELDOUT_FILE, Manifest, load_stream

NUM_PROMPTS = 20
MIN_TOKENS = 64
MAX_TOKENS = 200


@dataclass(frozen=True)
class HeldoutPrompt:
    file: str  # the held-out file, relative to the corpus root
    token_ids: list[int]


def _split_files(stream: np.ndarray, eot_id: int) -> list[np.ndarray]:
    """The stream's per-file token runs (each file ends with one `<|endoftext|>`)."""
    ends = np.flatnonzero(stream == eot_id)
    starts = np.concatenate(([0], ends[:-1] + 1))
    return [stream[s:e] for s, e in zip(starts, ends)]


def _prefix_length(path: str, min_tokens: int, max_tokens: int) -> int:
    digest = int(hashlib.sha256(path.encode("utf-8")).hexdigest(), 16)
    return min_tokens + digest % (max_tokens - min_tokens + 1)


def heldout_prompts(data_dir: str, count: int = NUM_PROMPTS, min_tokens: int = MIN_TOKENS,
                    max_tokens: int = MAX_TOKENS) -> list[HeldoutPrompt]:
    """`count` prompts cut from the held-out files of the prepared `data_dir` (see module doc)."""
    _check_lengths(min_tokens, max_tokens)
    manifest = Manifest.read(data_dir)
    return cut_prompts(load_stream(data_dir, HELDOUT_FILE), manifest.special_tokens[EOT],
                       manifest.heldout_files, count, min_tokens, max_tokens, where=data_dir)


def cut_prompts(stream: np.ndarray, eot_id: int, files: list[str], count: int = NUM_PROMPTS,
                min_tokens: int = MIN_TOKENS, max_tokens: int = MAX_TOKENS,
                where: str = "the held-out stream") -> list[HeldoutPrompt]:
    """`count` prompts cut from a held-out token stream (`files`: its files' paths, in stream
    order; see module doc). `where` names the stream in errors."""
    _check_lengths(min_tokens, max_tokens)
    runs = _split_files(stream, eot_id)
    if len(runs) != len(files):
        raise ValueError(f"{where}: {len(runs)} held-out token runs for {len(files)} held-out "
                         f"files")
    prompts = [HeldoutPrompt(path, ids[:_prefix_length(path, min_tokens, max_tokens)].tolist())
               for path, ids in zip(files, runs) if len(ids) >= max_tokens]
    if len(prompts) < count:
        raise ValueError(f"{where}: only {len(prompts)} held-out files have {max_tokens} "
                         f"tokens; {count} prompts were asked for")
    return prompts[:count]


def _check_lengths(min_tokens: int, max_tokens: int) -> None:
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")


def prompts_json(prompts: list[HeldoutPrompt]) -> str:
    """The committed file's text: one prompt per line."""
    lines = ",\n".join("  " + json.dumps(asdict(p)) for p in prompts)
    return "[\n" + lines + "\n]\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m photon.train.prompts",
                                description="Write prompts of held-out code as JSON.")
    p.add_argument("--data", required=True, help="a directory made by `photon.train prepare`")
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--count", type=int, default=NUM_PROMPTS)
    args = p.parse_args(argv)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(prompts_json(heldout_prompts(args.data, args.count)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
