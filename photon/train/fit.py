"""`fit` and `agree` as functions: build, train, evaluate and save one model; measure a pair."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from photon.train.evaluate import Agreement, HeldoutLoss, agreement, heldout_loss
from photon.train.export import TrainingRecord, device_name, round_to_bf16, save_model
from photon.train.loop import MIN_LR_RATIO, WEIGHT_DECAY, FitResult, FitSettings, train
from photon.train.presets import Preset, qwen3_config
from photon.train.tokenizer import HELDOUT_FILE, TRAIN_FILE, Manifest, load_stream


def log_line(text: str) -> None:
    print(text, flush=True)  # flushed: training logs are followed live, often through a pipe


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r}: CUDA is not available here; use cpu or auto")
    return torch.device(name)


def build_model(preset: Preset, manifest: Manifest, seed: int) -> torch.nn.Module:
    """A freshly initialised float32 Qwen3ForCausalLM (initialisation seeded by `seed`)."""
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(preset, manifest.vocab_size, manifest.special_tokens)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).float()


@dataclass(frozen=True)
class FitOutcome:
    result: FitResult
    heldout: HeldoutLoss
    record: TrainingRecord


def fit(data_dir: str, preset: Preset, settings: FitSettings, out_dir: str,
        device: torch.device, max_eval_windows: int | None = None,
        log: Callable[[str], None] | None = None) -> FitOutcome:
    import transformers

    log = log or log_line
    manifest = Manifest.read(data_dir)
    model = build_model(preset, manifest, settings.seed).to(device)
    params = sum(p.numel() for p in model.parameters())
    log(f"{preset.model_name}: preset {preset.name}, {params:,} parameters, device {device}")
    stream = load_stream(data_dir, HELDOUT_FILE)
    result = train(model, load_stream(data_dir, TRAIN_FILE), settings, device, log,
                   _selection_loss(stream, settings))
    round_to_bf16(model)
    if max_eval_windows is not None:
        stream = stream[: max_eval_windows * settings.seq_len + 1]
    held = heldout_loss(model, stream, settings.seq_len, device)
    log(f"held-out loss {held.loss:.4f} perplexity {held.perplexity:.3f} "
        f"({held.tokens:,} tokens)")
    record = TrainingRecord(
        preset=preset.name, parameters=params, steps=result.steps,
        tokens_seen=result.tokens_seen, seed=settings.seed, lr=settings.lr,
        min_lr_ratio=MIN_LR_RATIO, warmup_steps=settings.warmup_steps,
        weight_decay=WEIGHT_DECAY, batch_size=settings.batch_size, seq_len=settings.seq_len,
        budget_seconds=settings.seconds, python_version=manifest.python_version,
        corpus_sha256=manifest.corpus_sha256, corpus_bytes=manifest.corpus_bytes,
        corpus_files=manifest.num_files, heldout_files=manifest.num_heldout_files,
        train_tokens=manifest.train_tokens, heldout_tokens=held.tokens,
        tokenizer_sha256=manifest.tokenizer_sha256, heldout_loss=held.loss,
        heldout_perplexity=held.perplexity, elapsed_seconds=round(result.elapsed_seconds, 1),
        device=device_name(device), torch_version=torch.__version__,
        transformers_version=transformers.__version__, selected_step=result.selected_step)
    save_model(model, out_dir, data_dir, manifest, preset, record)
    log(f"saved {out_dir}")
    return FitOutcome(result=result, heldout=held, record=record)


def _selection_loss(stream: np.ndarray, settings: FitSettings
                    ) -> Callable[[torch.nn.Module], float]:
    """The loss `--eval-interval` selects the weights by: held-out loss over the last
    `eval_windows` windows of the held-out stream (the reported held-out loss reads them all)."""
    tail = stream[-(settings.eval_windows * settings.seq_len + 1):]
    return lambda model: heldout_loss(model, tail, settings.seq_len,
                                      next(model.parameters()).device).loss


def load_trained(model_dir: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()


def trained_seq_len(model_dir: str, default: int = 256) -> int:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return int(json.load(f).get("photon_training", {}).get("seq_len", default))


def agree(target_dir: str, draft_dir: str, data_dir: str, windows: int,
          seq_len: int | None, device: torch.device) -> Agreement:
    stream = load_stream(data_dir, HELDOUT_FILE)
    seq_len = seq_len or trained_seq_len(target_dir)
    target, draft = load_trained(target_dir, device), load_trained(draft_dir, device)
    return agreement(target, draft, stream, seq_len, windows, device)


def agreement_report(result: Agreement, out_path: str | None) -> str:
    """The agreement as printed text; also written as JSON to `out_path` when given."""
    if out_path:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(asdict(result), f, indent=2, sort_keys=True)
            f.write("\n")
    lines = [f"greedy agreement {result.agreement:.4f} over {result.positions:,} positions "
             f"({result.windows} held-out windows)",
             "K  accepted/step (measured)  (independent)  tokens/step (measured)"]
    for k in sorted(result.accepted_measured):
        m, ind = result.accepted_measured[k], result.accepted_independent[k]
        lines.append(f"{k}  {m:24.3f}  {ind:13.3f}  {1 + m:22.3f}")
    return "\n".join(lines)
