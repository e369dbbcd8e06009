"""`python -m photon.train prepare|fit|agree|all`: see docs/training.md."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from photon.train.presets import PRESETS, get_preset
from photon.train.tokenizer import DEFAULT_VOCAB_SIZE, MANIFEST_FILE


@dataclass(frozen=True)
class Pair:
    target: str
    draft: str
    target_seconds: float
    draft_seconds: float


# `all --pair`: the presets and default time budgets (seconds of training per model).
PAIRS = {"tiny": Pair("tiny", "draft", 60.0, 60.0),
         "bench": Pair("bench", "bench-draft", 240.0, 80.0)}


def _add_prepare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help="BPE vocabulary size, special tokens included (default %(default)s)")
    p.add_argument("--stdlib", default=None,
                   help="corpus root (default: this Python's standard library)")


def _add_fit_args(p: argparse.ArgumentParser, single: bool) -> None:
    if single:
        p.add_argument("--seconds", type=float, default=None,
                       help="time budget; the step count is fixed from the first steps' speed")
        p.add_argument("--steps", type=int, default=None, help="step budget")
        p.add_argument("--lr", type=float, default=None, help="peak lr; default: the preset's")
        p.add_argument("--warmup", type=int, default=None, help="default: the preset's")
    p.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:N")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (off by default)")
    p.add_argument("--eval-interval", type=int, default=0,
                   help="evaluate on held-out windows every N steps (and after the last) and "
                        "save the weights of the best evaluation: a long budget on a small "
                        "corpus overfits (default 0: save the last weights)")
    p.add_argument("--eval-windows", type=int, default=32,
                   help="held-out windows each --eval-interval evaluation reads (the last ones "
                        "of the held-out stream; default %(default)s)")
    p.add_argument("--max-eval-windows", type=int, default=None,
                   help="evaluate only this many held-out windows (default: the whole stream)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m photon.train",
        description="Train photon's small models on the Python standard library's sources.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="corpus + tokenizer + token streams into --out")
    p.add_argument("--out", required=True)
    _add_prepare_args(p)
    p = sub.add_parser("fit", help="train one model on a prepared --data directory")
    p.add_argument("--data", required=True)
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", required=True)
    _add_fit_args(p, single=True)
    p = sub.add_parser("agree", help="the draft's greedy agreement with the target")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--windows", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=None, help="default: the target's")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None, help="also write the result as JSON to this file")
    p = sub.add_parser("all", help="prepare + fit target + fit draft + agree into --out")
    p.add_argument("--out", required=True)
    p.add_argument("--pair", choices=sorted(PAIRS), default="tiny")
    p.add_argument("--data", default=None, help="reuse this prepared directory")
    p.add_argument("--target-seconds", type=float, default=None)
    p.add_argument("--draft-seconds", type=float, default=None)
    p.add_argument("--target-steps", type=int, default=None, help="instead of --target-seconds")
    p.add_argument("--draft-steps", type=int, default=None, help="instead of --draft-seconds")
    p.add_argument("--windows", type=int, default=256, help="agreement windows")
    _add_prepare_args(p)
    _add_fit_args(p, single=False)
    return parser


def _fit_settings(preset_name: str, args: argparse.Namespace, steps: int | None,
                  seconds: float | None) -> object:
    from photon.train.loop import FitSettings

    preset = get_preset(preset_name)
    pick = lambda name, default: default if getattr(args, name, None) is None else getattr(args, name)  # noqa: E731
    return FitSettings(
        seq_len=pick("seq_len", preset.seq_len), batch_size=pick("batch_size", preset.batch_size),
        lr=pick("lr", preset.lr), warmup_steps=pick("warmup", preset.warmup_steps),
        seed=args.seed, steps=steps, seconds=seconds, log_interval=args.log_interval,
        compile=args.compile, eval_interval=args.eval_interval, eval_windows=args.eval_windows)


def cmd_prepare(args: argparse.Namespace) -> int:
    from photon.train.tokenizer import prepare

    t0 = time.perf_counter()
    m = prepare(args.out, args.vocab_size, args.stdlib)
    print(f"prepared {args.out} in {time.perf_counter() - t0:.1f}s: {m.num_files} files "
          f"({m.num_heldout_files} held out), {m.corpus_bytes:,} bytes, vocabulary "
          f"{m.vocab_size}, {m.train_tokens:,} train / {m.heldout_tokens:,} held-out tokens", flush=True)
    return 0


def _run_fit(data: str, preset_name: str, out: str, args: argparse.Namespace,
             steps: int | None, seconds: float | None) -> None:
    from photon.train.fit import fit, resolve_device

    settings = _fit_settings(preset_name, args, steps, seconds)
    fit(data, get_preset(preset_name), settings, out, resolve_device(args.device),
        args.max_eval_windows)


def cmd_fit(args: argparse.Namespace) -> int:
    _run_fit(args.data, args.preset, args.out, args, args.steps, args.seconds)
    return 0


def cmd_agree(args: argparse.Namespace) -> int:
    from photon.train.fit import agree, agreement_report, resolve_device

    result = agree(args.target, args.draft, args.data, args.windows, args.seq_len,
                   resolve_device(args.device))
    print(agreement_report(result, args.json))
    return 0


def cmd_all(args: argparse.Namespace) -> int:
    from photon.train.fit import agree, agreement_report, resolve_device

    pair = PAIRS[args.pair]
    data = args.data or os.path.join(args.out, "data")
    if not os.path.isfile(os.path.join(data, MANIFEST_FILE)):
        cmd_prepare(argparse.Namespace(out=data, vocab_size=args.vocab_size, stdlib=args.stdlib))
    dirs = []
    for name, steps, seconds in ((pair.target, args.target_steps, args.target_seconds),
                                 (pair.draft, args.draft_steps, args.draft_seconds)):
        default = pair.target_seconds if name == pair.target else pair.draft_seconds
        seconds = None if steps is not None else (seconds or default)
        dirs.append(os.path.join(args.out, get_preset(name).model_name))
        _run_fit(data, name, dirs[-1], args, steps, seconds)
    result = agree(dirs[0], dirs[1], data, args.windows, None, resolve_device(args.device))
    print(agreement_report(result, os.path.join(args.out, "agreement.json")))
    return 0


COMMANDS = {"prepare": cmd_prepare, "fit": cmd_fit, "agree": cmd_agree, "all": cmd_all}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"error: {e}\n")
    return 2
