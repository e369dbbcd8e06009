"""Writing a trained model directory: bf16 safetensors shards under 16 MB, the tokenizer files,
generation_config.json, a config.json whose `photon_training` block states how it was made, and
a README.md."""

from __future__ import annotations

import inspect
import json
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Any

import torch

from photon.model.tiny import write_json
from photon.train.presets import Preset
from photon.train.tokenizer import TOKENIZER_FILES, Manifest

MAX_SHARD_SIZE = "15MB"
_RANDOM_MARKER = "photon_random_weights"


@dataclass(frozen=True)
class TrainingRecord:
    """config.json's `photon_training` block."""

    preset: str
    parameters: int
    steps: int
    tokens_seen: int
    seed: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    batch_size: int
    seq_len: int
    budget_seconds: float | None  # --seconds, when the step count was derived from it
    python_version: str
    corpus_sha256: str
    corpus_bytes: int
    corpus_files: int
    heldout_files: int
    train_tokens: int
    heldout_tokens: int
    tokenizer_sha256: str
    heldout_loss: float
    heldout_perplexity: float
    elapsed_seconds: float
    device: str
    torch_version: str
    transformers_version: str
    # --eval-interval: the step whose weights were saved (the best evaluation); None: the last
    selected_step: int | None = None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


@torch.no_grad()
def round_to_bf16(model: torch.nn.Module) -> None:
    """Round every parameter to bfloat16 (kept in its dtype), so evaluation sees what is saved."""
    for param in model.parameters():
        param.copy_(param.to(torch.bfloat16).to(param.dtype))


def save_model(model: torch.nn.Module, out_dir: str, data_dir: str, manifest: Manifest,
               preset: Preset, record: TrainingRecord) -> None:
    os.makedirs(out_dir, exist_ok=True)
    model = model.to(torch.bfloat16)
    kwargs: dict[str, Any] = {"max_shard_size": MAX_SHARD_SIZE}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4 (5 writes only safetensors)
    model.save_pretrained(out_dir, **kwargs)
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(data_dir, name), os.path.join(out_dir, name))
    _write_config(out_dir, record)
    special = manifest.special_tokens
    write_json(out_dir, "generation_config.json", {
        "bos_token_id": special["<|endoftext|>"],
        "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
        "do_sample": False,
    })
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_readme(preset, record))


def _write_config(out_dir: str, record: TrainingRecord) -> None:
    path = os.path.join(out_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.pop(_RANDOM_MARKER, None)
    config["photon_training"] = asdict(record)
    write_json(out_dir, "config.json", config)


def model_readme(preset: Preset, r: TrainingRecord) -> str:
    return f"""# {preset.model_name}

A {r.parameters / 1e6:.1f}M-parameter Qwen3-architecture model (hidden {preset.hidden_size},
{preset.num_layers} layers, {preset.num_heads} query / {preset.num_kv_heads} key-value heads,
tied embeddings) trained from scratch by photon's own training script on the Python
{r.python_version} standard library's source files, with a {r.tokenizer_sha256[:12]}... byte-level
BPE tokenizer trained on the same corpus (ChatML special tokens).

- Corpus: {r.corpus_files} files, {r.corpus_bytes:,} bytes, sha256 {r.corpus_sha256};
  {r.heldout_files} files held out ({r.heldout_tokens:,} tokens).
- Training: preset `{r.preset}`, {r.steps} steps of {r.batch_size} x {r.seq_len} tokens
  ({r.tokens_seen:,} tokens), AdamW (peak lr {r.lr:g}, {r.warmup_steps} warm-up steps, cosine to
  {r.min_lr_ratio:g} x), seed {r.seed}, {r.elapsed_seconds:.0f} s on {r.device}.
- Held-out loss {r.heldout_loss:.4f} nats/token, perplexity {r.heldout_perplexity:.2f}
  (bfloat16 weights, float32 compute).

It writes Python-looking code and nothing else of use. `config.json` holds the full record under
`photon_training`; `python -m photon.train` remakes it (see docs/training.md).
"""
