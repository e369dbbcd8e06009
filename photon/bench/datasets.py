"""Datasets of `photon bench serve` (vLLM's `--dataset-name`): random, sharegpt, standard.

ShareGPT is read as vLLM's `bench serve` reads it: a JSON list of `{"id", "conversations":
[{"from": "human" | "gpt", "value": str}, ...]}`; entries with fewer than two turns are dropped,
the rest shuffled by `random.Random(seed)` (the order `random.seed(seed); random.shuffle(...)`
gives). Each entry's first human turn is the prompt and the first gpt reply after it gives the
output length (its token count, or `--sharegpt-output-len`). Pairs are taken in shuffled order
while they pass vLLM's filter: prompt and output at least 4 tokens (the output check skipped when
the length is fixed), prompt at most 1024 and prompt + output at most 2048 tokens. With fewer
pairs than requests, the sample is topped up by seeded random choice, as vLLM oversamples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from photon.bench.serve_workload import RequestSpec

if TYPE_CHECKING:
    from photon.bench.serve_tokenizer import TextTokenizer

DATASET_NAMES = ("random", "sharegpt", "standard", "multiturn")
DATASETS_WITH_PATH = ("sharegpt",)
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
_COUNT_BATCH = 64  # pairs tokenized concurrently while sampling


@dataclass(frozen=True)
class Conversation:
    prompt: str
    completion: str


def _read_json(path: str) -> Any:
    if not Path(path).is_file():
        raise ValueError(f"--dataset-path: no such file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--dataset-path {path}: cannot read it: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path {path}: not valid JSON ({e}); ShareGPT is one JSON "
                         "list of {'id', 'conversations': [...]} objects") from None


def _first_pair(turns: list[Any]) -> Conversation | None:
    """The first human turn and the first gpt reply after it, if both are there as text."""
    prompt = None
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            continue
        if prompt is None and turn.get("from") == "human":
            prompt = turn["value"]
        elif prompt is not None and turn.get("from") == "gpt":
            return Conversation(prompt, turn["value"])
    return None


def load_sharegpt(path: str, seed: int) -> list[Conversation]:
    """The file's (prompt, reply) pairs in the seeded shuffled order."""
    data = _read_json(path)
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of ShareGPT entries "
                         f"{{'id', 'conversations': [...]}}, got a {type(data).__name__}")
    entries = [e for e in data if isinstance(e, dict) and isinstance(e.get("conversations"), list)
               and len(e["conversations"]) >= 2]
    random.Random(seed).shuffle(entries)
    pairs = [p for p in (_first_pair(e["conversations"]) for e in entries) if p is not None]
    if not pairs:
        raise ValueError(f"--dataset-path {path}: no ShareGPT conversation with a 'human' turn "
                         "followed by a 'gpt' reply")
    return pairs


def valid_lengths(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    """vLLM's ShareGPT filter (is_valid_sequence with its defaults)."""
    too_short = prompt_len < MIN_LEN or (not fixed_output and output_len < MIN_LEN)
    return not too_short and prompt_len <= MAX_PROMPT_LEN and \
        prompt_len + output_len <= MAX_TOTAL_LEN


async def _lengths(tok: TextTokenizer, pair: Conversation,
                   output_len: int | None) -> tuple[int, int]:
    prompt_len = len(await tok.encode(pair.prompt))
    if output_len is not None:
        return prompt_len, output_len
    return prompt_len, len(await tok.encode(pair.completion))


async def sample_sharegpt(pairs: Sequence[Conversation], tok: TextTokenizer, num: int,
                          output_len: int | None, seed: int) -> list[RequestSpec]:
    """`num` requests: the pairs that pass the filter, in order, oversampled when too few."""
    specs: list[RequestSpec] = []
    for start in range(0, len(pairs), _COUNT_BATCH):
        batch = pairs[start:start + _COUNT_BATCH]
        lengths = await asyncio.gather(*(_lengths(tok, p, output_len) for p in batch))
        for pair, (n_in, n_out) in zip(batch, lengths):
            if len(specs) < num and valid_lengths(n_in, n_out, output_len is not None):
                specs.append(RequestSpec(pair.prompt, n_out, n_in))
        if len(specs) >= num:
            return specs
    if not specs:
        raise ValueError(
            f"no ShareGPT conversation passes the length filter (prompt {MIN_LEN}-"
            f"{MAX_PROMPT_LEN} tokens, reply at least {MIN_LEN}, both at most {MAX_TOTAL_LEN})")
    rng = random.Random(seed)
    return specs + [rng.choice(specs) for _ in range(num - len(specs))]


# ---------------------------------------------------------------- flags


def add_dataset_args(g: Any) -> None:
    """vLLM's dataset flags, and photon's --dataset and --tokenizer."""
    g.add_argument("--dataset-name", choices=DATASET_NAMES, default=None,
                   help="random (default: random token ids, --random-*), sharegpt (ShareGPT "
                        "JSON at --dataset-path, as vLLM reads it) or standard (the offline "
                        "nano-vllm workload: 100-1024 tokens in and out) or multiturn (chats "
                        "whose turns carry their history; see the multi-turn flags).")
    g.add_argument("--dataset-path", default=None, metavar="FILE",
                   help="The dataset file of --dataset-name sharegpt.")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="Output tokens of every ShareGPT request (default: its reply's length).")
    g.add_argument("--dataset", default=None, metavar="PATH",
                   help="JSONL rows {'prompt': str | [ids], 'output_len': int}, or 'standard' "
                        "(the same as --dataset-name standard).")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="Count tokens (ShareGPT lengths, chat prompt sizes) with this model "
                        "directory's tokenizer instead of the server's POST /tokenize.")


def check_dataset_args(ns: argparse.Namespace) -> None:
    """Resolves ns.dataset_name (and the older --dataset) or says which flags clash."""
    if ns.dataset is not None:
        if ns.dataset_name is not None or ns.dataset_path is not None:
            raise ValueError("give --dataset-name/--dataset-path or --dataset, not both")
        ns.dataset_name, ns.dataset_path = (("standard", None) if ns.dataset == "standard"
                                            else ("jsonl", ns.dataset))
    ns.dataset_name = ns.dataset_name or "random"
    if ns.dataset_name in DATASETS_WITH_PATH and not ns.dataset_path:
        raise ValueError(f"--dataset-name {ns.dataset_name} needs --dataset-path FILE")
    if ns.dataset_path and ns.dataset_name not in (*DATASETS_WITH_PATH, "jsonl"):
        raise ValueError(f"--dataset-path is read only with --dataset-name "
                         f"{'/'.join(DATASETS_WITH_PATH)}, not {ns.dataset_name}")
    if ns.sharegpt_output_len is not None and ns.sharegpt_output_len < 1:
        raise ValueError(f"--sharegpt-output-len must be positive, got {ns.sharegpt_output_len}")


# ---------------------------------------------------------------- the requests of a run


@dataclass
class DatasetOptions:
    """The workload flags of `photon bench serve`."""

    name: str  # one of DATASET_NAMES, or "jsonl" (--dataset FILE)
    path: str | None
    num_prompts: int | None
    input_len: int
    output_len: int
    range_ratio: float
    vocab_size: int
    seed: int
    sharegpt_output_len: int | None = None
    tokenizer: str | None = None  # a local model directory, else the server's /tokenize


def base_requests(opts: DatasetOptions) -> list[RequestSpec]:
    """The requests of the datasets that need no tokenizer."""
    from photon.bench import serve_workload as sw

    if opts.name == "standard":
        return sw.standard_requests(opts.num_prompts, opts.vocab_size, opts.seed)
    if opts.name == "jsonl":
        return sw.load_dataset(opts.path or "", opts.num_prompts)
    return sw.random_requests(opts.num_prompts or 200, opts.input_len, opts.output_len,
                              opts.range_ratio, opts.vocab_size, opts.seed)


async def build_requests(opts: DatasetOptions, cfg: Any, pairs: Sequence[Conversation] | None,
                         log: Callable[[str], None]) -> list[RequestSpec]:
    """The run's requests; ShareGPT's lengths and chat prompts' sizes come from the tokenizer."""
    from photon.bench.serve_tokenizer import open_tokenizer

    specs = base_requests(opts) if pairs is None else []
    needs_sizing = cfg.chat and any(isinstance(s.prompt, list) for s in specs)
    if pairs is None and not needs_sizing:
        return specs
    async with open_tokenizer(cfg, opts.tokenizer) as tok:
        if pairs is not None:
            specs = await _sharegpt_requests(opts, pairs, tok)
        if cfg.chat:
            specs = await _chat_requests(tok, specs, log)
    return specs


async def _sharegpt_requests(opts: DatasetOptions, pairs: Sequence[Conversation],
                             tok: TextTokenizer) -> list[RequestSpec]:
    try:
        return await sample_sharegpt(pairs, tok, opts.num_prompts or 200,
                                     opts.sharegpt_output_len, opts.seed)
    except ValueError:
        raise
    except Exception as e:  # no /tokenize on this server, or it failed
        raise ValueError(f"counting ShareGPT tokens needs the server's POST /tokenize (photon and "
                         f"vLLM serve it) or --tokenizer DIR: {type(e).__name__}: {e}") from None


async def _chat_requests(tok: TextTokenizer, specs: list[RequestSpec],
                         log: Callable[[str], None]) -> list[RequestSpec]:
    """Token-id prompts sized to their length after the chat template; without a tokenizer,
    one common word per id (the server's usage then reports the real length)."""
    from photon.bench.serve_tokenizer import size_chat_prompts

    if not any(isinstance(s.prompt, list) for s in specs):  # texts: the server counts them
        return [replace(s, prompt_len=None) for s in specs]
    try:
        sized = await size_chat_prompts(tok, specs)
    except ValueError:
        raise
    except Exception as e:  # a server without /tokenize: prompt lengths become approximate
        log(f"chat prompts are not sized to their token lengths ({type(e).__name__}: {e}); "
            "--tokenizer DIR sizes them locally")
        return [replace(s, prompt_len=None) for s in specs]
    off = sum(s.prompt_len != len(o.prompt) for s, o in zip(sized, specs)
              if isinstance(o.prompt, list))
    log("chat prompts sized to their token lengths after the chat template"
        + (f" ({off} could not be matched exactly)" if off else ""))
    return sized
