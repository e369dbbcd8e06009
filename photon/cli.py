"""`photon` command line: generate, serve, bench (more subcommands register themselves in SUBCOMMANDS)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from photon.config import ConfigError, EngineArgs

SAMPLING_FLAGS: dict[str, tuple[type, str]] = {
    "max_tokens": (int, "Most tokens to generate per completion (default 16)."),
    "temperature": (float, "Sampling temperature; 0 = greedy (default 1.0)."),
    "top_p": (float, "Nucleus sampling probability mass (default 1.0 = off)."),
    "top_k": (int, "Sample among the k most likely tokens (default 0 = off)."),
    "min_p": (float, "Drop tokens below min_p x the top probability (default 0 = off)."),
    "n": (int, "Completions per prompt (default 1)."),
    "sampling_seed": (int, "Per-request seed: same seed, same output (default: from --seed)."),
    "min_tokens": (int, "Generate at least this many tokens before EOS/stop ids count."),
    "presence_penalty": (float, "Penalty in [-2, 2] for tokens already generated."),
    "frequency_penalty": (float, "Penalty in [-2, 2] scaled by how often a token appeared."),
    "repetition_penalty": (float, "Multiplicative penalty > 0 on seen tokens (1 = off)."),
    "logprobs": (int, "Return this many top logprobs per token (0-20)."),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine arguments (vLLM names)")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_text)
            continue
        base = str(f.type).split(" | ")[0]  # annotations are strings: "int | None"
        kind = {"int": int, "float": float}.get(base, str)
        group.add_argument(flag, type=kind, default=f.default, help=help_text)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{name: getattr(ns, name) for name in EngineArgs.field_names()})


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", allow_abbrev=False, help="Generate completions for prompts and print them.",
                       description="Generate completions for the given prompts (offline batch).")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="Prompt text(s).")
    for name, (kind, help_text) in SAMPLING_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=help_text)
    p.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    p.add_argument("--stop-token-ids", type=int, nargs="+", default=None, help="Stop token ids.")
    p.add_argument("--ignore-eos", action="store_true", help="Keep generating past EOS.")
    p.add_argument("--chat", action="store_true", help="Wrap each prompt in the chat template.")
    p.add_argument("--json", action="store_true", help="Print one JSON object per prompt.")
    p.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def _sampling_params(ns: argparse.Namespace) -> Any:
    from photon.sampling_params import SamplingParams

    kwargs = {name: getattr(ns, name) for name in SAMPLING_FLAGS if getattr(ns, name) is not None}
    if "sampling_seed" in kwargs:
        kwargs["seed"] = kwargs.pop("sampling_seed")
    return SamplingParams(stop=ns.stop, stop_token_ids=ns.stop_token_ids,
                          ignore_eos=ns.ignore_eos, **kwargs)


def run_generate(ns: argparse.Namespace) -> int:
    from photon.llm import LLM
    from photon.model.tiny import is_random_weights

    params = _sampling_params(ns)
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    if is_random_weights(llm.config.model.model):
        print(f"[{llm.config.model.served_model_name}: RANDOM WEIGHTS - the text is meaningless]",
              file=sys.stderr)
    prompts = list(ns.prompts)
    if ns.chat:
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    outputs = llm.generate(prompts, params, use_tqdm=not ns.no_progress)
    for prompt, out in zip(ns.prompts, outputs):
        if ns.json:
            print(json.dumps({"prompt": prompt, "completions": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in out.outputs]}))
            continue
        for c in out.outputs:
            print(f"--- prompt: {prompt!r} [{c.finish_reason}, {len(c.token_ids)} tokens]")
            print(prompt + c.text)
    return 0


def _add_bench(sub: Any) -> None:
    from photon.bench.cli import add_bench

    add_bench(sub)


def _add_serve(sub: Any) -> None:
    from photon.server.launch import add_serve

    add_serve(sub)


SUBCOMMANDS: list[Callable[[Any], None]] = [_add_generate, _add_serve, _add_bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="photon",
        allow_abbrev=False,
        description="photon: LLM inference with pipelined decoding. "
                    "Run `photon COMMAND --help` for the options of a command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except (ConfigError, ValueError, TypeError) as e:
        print(f"photon {ns.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
