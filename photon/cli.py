"""`photon` command line: generate, serve, bench, router, proxy, quantize (more subcommands
register themselves in SUBCOMMANDS).

Every usage error is one line, `photon SUBCOMMAND: error: ...`, with exit code 2; `--help` lists each
option's default and the allowed values of choice options.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from photon.config import ConfigError, ModelConfig
from photon.engine_args import EngineArgs


class HelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to an option's help unless the help already speaks of its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = default_text(action)
        if shown is None or "default" in text.lower():
            return text
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


class RawDescriptionHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """HelpFormatter that keeps the description's line breaks (module docstrings)."""


def default_text(action: argparse.Action) -> str | None:
    """How `--help` shows an option's default; None when there is nothing worth showing."""
    default = action.default
    if isinstance(action, argparse.BooleanOptionalAction):
        return action.option_strings[0 if default else 1]  # "--flag" or "--no-flag"
    if not action.option_strings or default is None or default is False \
            or default is argparse.SUPPRESS:
        return None
    if isinstance(default, (list, tuple)):
        return " ".join(str(v) for v in default)
    return str(default)


class CLIParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) and whose help shows defaults.

    Subparsers are of the same class (argparse makes them with `type(parent)`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


SAMPLING_FLAGS: dict[str, tuple[type, str]] = {
    "max_tokens": (int, "Most tokens to generate per completion (default 16)."),
    "temperature": (float, "Sampling temperature; 0 = greedy (default 1.0)."),
    "top_p": (float, "Nucleus sampling probability mass (default 1.0 = off)."),
    "top_k": (int, "Sample among the k most likely tokens (default 0 = off)."),
    "min_p": (float, "Drop tokens below min_p x the top probability (default 0 = off)."),
    "n": (int, "Completions per prompt (default 1)."),
    "sampling_seed": (int, "Per-request seed: same seed, same output (default: from --seed)."),
    "min_tokens": (int, "Generate at least this many tokens before EOS/stop ids count "
                        "(default 0)."),
    "presence_penalty": (float, "Penalty in [-2, 2] for tokens already generated (default 0)."),
    "frequency_penalty": (float, "Penalty in [-2, 2] scaled by how often a token appeared "
                                 "(default 0)."),
    "repetition_penalty": (float, "Multiplicative penalty > 0 on seen tokens (default 1 = off)."),
    "logprobs": (int, "Print each generated token's logprob and this many most likely "
                      "alternatives (0-20; default: none printed)."),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine arguments (vLLM names)")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        names = (flag, *f.metadata.get("aliases", ()))
        help_text = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            group.add_argument(*names, action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_text)
            continue
        base = str(f.type).split(" | ")[0]  # annotations are strings: "int | None"
        kind = {"int": int, "float": float}.get(base, str)
        choices = f.metadata.get("choices")
        # Allowed values show in the metavar; EngineArgs.create_config checks them (one message
        # for the Python API and the CLI).
        metavar = "{" + ",".join(choices) + "}" if choices else None
        extra = {"nargs": f.metadata["nargs"]} if "nargs" in f.metadata else {}
        group.add_argument(*names, type=kind, default=f.default, help=help_text, metavar=metavar,
                           **extra)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{name: getattr(ns, name) for name in EngineArgs.field_names()})


def print_model_notices(model: ModelConfig) -> None:
    """Startup lines on stderr: random weights (photon-tiny-random), the model's default sampling
    parameters (its generation_config.json)."""
    from photon.model.tiny import is_random_weights

    if is_random_weights(model.model):
        print(f"[{model.served_model_name}: RANDOM WEIGHTS - the text is meaningless]",
              file=sys.stderr)
    notice = model.generation_defaults.notice(model.served_model_name) \
        if model.generation_defaults else None
    if notice:
        print(notice, file=sys.stderr)


def _add_generate(sub: Any) -> None:
    from photon.cli_generate import add_generate

    add_generate(sub)


def _add_bench(sub: Any) -> None:
    from photon.bench.cli import add_bench

    add_bench(sub)


def _add_serve(sub: Any) -> None:
    from photon.server.launch import add_serve

    add_serve(sub)


def _add_router(sub: Any) -> None:
    from photon.router.cli import add_router

    add_router(sub)


def _add_proxy(sub: Any) -> None:
    from photon.proxy.launch import add_proxy

    add_proxy(sub)


def _add_quantize(sub: Any) -> None:
    from photon.quant.cli import add_quantize

    add_quantize(sub)


SUBCOMMANDS: list[Callable[[Any], None]] = [_add_generate, _add_serve, _add_bench, _add_router,
                                             _add_proxy, _add_quantize]


def build_parser() -> CLIParser:
    parser = CLIParser(
        prog="photon",
        description="photon: LLM inference with pipelined decoding. "
                    "Run `photon COMMAND --help` for the options of a command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def command_parser(parser: argparse.ArgumentParser, ns: argparse.Namespace
                   ) -> argparse.ArgumentParser:
    """The (sub)parser that parsed the innermost command named in `ns` (`photon bench serve`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(ns, action.dest, None)
            if name in action.choices:
                return command_parser(action.choices[name], ns)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns, extras = parser.parse_known_args(argv)
    command = command_parser(parser, ns)
    if extras:  # reported by the subcommand that got them, not by `photon`
        command.error(f"unrecognized arguments: {' '.join(extras)}")
    try:
        return int(ns.func(ns) or 0)
    except (ConfigError, ValueError, TypeError) as e:
        print(f"{command.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
