"""Inputs of `photon bench quality`: held-out token windows, and full next-token distributions of
one window from photon's model runner (one prefill through its attention backend and KV cache)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import torch

from photon.config import ConfigError, ModelConfig

LOGITS_CHUNK = 256  # positions whose [N, vocab] float32 logits exist at once


def load_token_windows(data: str | None, count: int, length: int, model: ModelConfig,
                       seed: int = 0) -> list[list[int]]:
    """`count` windows of `length` token ids (see --data); random ids when data is None."""
    from photon.bench.spec_prompts import _windows, heldout_code_prompts, random_prompts

    if data is None:
        return random_prompts(count, length, model.vocab_size, seed)
    if os.path.isdir(data):
        return heldout_code_prompts(data, count, length, model.model)
    if not os.path.isfile(data):
        raise ConfigError(f"--data {data!r} is neither a prepared data directory nor a file")
    return _windows(_file_stream(data, model.model), count, length)


def _file_stream(path: str, model_dir: str) -> list[int]:
    """A JSON file's token ids (lists, or objects with token_ids, concatenated), or a text
    file's text through the model's tokenizer."""
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            items = json.load(f)
        if not isinstance(items, list):
            raise ConfigError(f"--data {path}: expected a JSON list of token-id lists")
        return [int(t) for item in items
                for t in (item["token_ids"] if isinstance(item, dict) else item)]
    from tokenizers import Tokenizer

    with open(path, encoding="utf-8") as f:
        text = f.read()
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    return tokenizer.encode(text, add_special_tokens=False).ids


class WindowScorer:
    """A ModelRunner for scoring windows of up to `max_len` tokens: eager, one sequence, a KV
    cache of just those blocks (so the reference and the quantized model fit side by side)."""

    def __init__(self, args: Any, max_len: int) -> None:
        from photon.worker.model_runner import ModelRunner

        if args.tensor_parallel_size != 1:
            raise ConfigError("photon bench quality runs the model on one rank: leave "
                              "--tensor-parallel-size at 1")
        blocks = math.ceil(max_len / args.block_size) + 1
        config = dataclasses.replace(args, enforce_eager=True, max_num_seqs=1,
                                     num_gpu_blocks_override=blocks,
                                     max_model_len=args.max_model_len or max_len).create_config()
        if max_len > config.model.max_model_len:
            raise ConfigError(f"--window-len {max_len} is longer than max_model_len "
                              f"{config.model.max_model_len}")
        self.runner = ModelRunner(config)

    @torch.inference_mode()
    def log_probs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] float32 next-token log-probabilities (CPU) after each prefix."""
        from photon.attention.backend import ForwardContext

        r = self.runner
        dev = r.device
        meta = _one_sequence(len(ids), r.block_size, dev)
        hidden = r.model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev),
                         ForwardContext(meta, r.kv_caches, r.backend, r.kv_scales))
        if r.kv_scales is not None:
            r.kv_scales.finish_calibration()
        out = [torch.log_softmax(r.model.compute_logits(hidden[a:a + LOGITS_CHUNK]).float(), -1)
               .cpu() for a in range(0, len(ids), LOGITS_CHUNK)]
        return torch.cat(out)

    def close(self) -> None:
        del self.runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _one_sequence(n: int, block_size: int, device: torch.device) -> Any:
    """A prefill of one n-token sequence in blocks 1, 2, ... (block 0 is the null block)."""
    from photon.attention.backend import AttentionMetadata

    pos = torch.arange(n, device=device)
    table = torch.arange(1, math.ceil(n / block_size) + 1, dtype=torch.int32, device=device)
    return AttentionMetadata(
        slot_mapping=table.long()[pos // block_size] * block_size + pos % block_size,
        block_tables=table[None], seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens_host=[n], query_lens_host=[n], decode_only=n == 1)
