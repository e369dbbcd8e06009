"""`photon generate`: offline generation from the command line, printed as text or JSON lines.

With `--chat` each prompt is one user message rendered by the model's chat template; what is
printed as the prompt is that rendered text, the exact input the model saw (as vLLM's
`RequestOutput.prompt`). With `--logprobs K` every generated token's logprob and its K most likely
alternatives are printed too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from photon.cli import SAMPLING_FLAGS, add_engine_args, engine_args_from, print_model_notices
from photon.outputs import Logprob

# JSON has no -Infinity: a token the model gives probability 0 is reported with this logprob.
MIN_LOGPROB = -9999.0


def add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="Generate completions for prompts and print them.",
                       description="Generate completions for the given prompts (offline batch). "
                                   "Sampling flags not given take the model's defaults from its "
                                   "generation_config.json (see --generation-config).")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="Prompt text(s).")
    for name, (kind, help_text) in SAMPLING_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=help_text)
    p.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    p.add_argument("--stop-token-ids", type=int, nargs="+", default=None, help="Stop token ids.")
    p.add_argument("--ignore-eos", action="store_true", help="Keep generating past EOS.")
    p.add_argument("--chat", action="store_true",
                   help="Send each prompt as a user message through the model's chat template; "
                        "the templated text is printed as the prompt.")
    p.add_argument("--json", action="store_true", help="Print one JSON object per prompt.")
    p.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")
    add_engine_args(p)
    p.set_defaults(func=run_generate)


@dataclass
class Prompt:
    """A prompt as the user typed it and as the model saw it (the chat-templated text)."""

    given: str
    seen: str
    token_ids: list[int] | None = None  # set for chat prompts (tokenized without special tokens)


def _sampling_params(ns: argparse.Namespace, defaults: dict[str, Any]) -> Any:
    """The flags given, over `defaults` (the model's generation_config.json defaults)."""
    from photon.sampling_params import SamplingParams

    kwargs = {name: getattr(ns, name) for name in SAMPLING_FLAGS if getattr(ns, name) is not None}
    if "sampling_seed" in kwargs:
        kwargs["seed"] = kwargs.pop("sampling_seed")
    return SamplingParams(stop=ns.stop, stop_token_ids=ns.stop_token_ids,
                          ignore_eos=ns.ignore_eos, **{**defaults, **kwargs})


def _prompts(ns: argparse.Namespace, tokenizer: Any) -> list[Prompt]:
    if not ns.chat:
        return [Prompt(p, p) for p in ns.prompts]
    prompts = []
    for given in ns.prompts:
        seen = tokenizer.apply_chat_template([{"role": "user", "content": given}])
        # The template already holds the special tokens (as the server's chat endpoint does).
        prompts.append(Prompt(given, seen, tokenizer.encode(seen, add_special_tokens=False)))
    return prompts


def run_generate(ns: argparse.Namespace) -> int:
    from photon.llm import LLM

    # Bad sampling flags fail before the model loads (max_tokens may come from the model).
    _sampling_params(ns, {"max_tokens": None})
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    defaults = llm.config.model.generation_defaults
    params = _sampling_params(ns, defaults.as_kwargs() if defaults else {})
    print_model_notices(llm.config.model)
    tokenizer = llm.get_tokenizer()
    prompts = _prompts(ns, tokenizer)
    inputs = [p.token_ids if p.token_ids is not None else p.seen for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=not ns.no_progress)
    for prompt, out in zip(prompts, outputs):
        if ns.json:
            print(json.dumps(_json_output(prompt, out, params.logprobs, tokenizer, ns.chat)))
        else:
            print(_text_output(prompt, out, params.logprobs, tokenizer, ns.chat))
    return 0


# ---------------------------------------------------------------- logprobs


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    rank: int | None  # 1-based rank in the model's distribution

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _clamp(value: float) -> float:
    return value if math.isfinite(value) else (MIN_LOGPROB if value < 0 else 0.0)


def token_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                   tokenizer: Any) -> list[tuple[TokenLogprob, list[TokenLogprob]]]:
    """Per generated token: (the sampled token, its k most likely alternatives, best first)."""
    def item(tid: int, lp: Logprob) -> TokenLogprob:
        text = lp.decoded_token
        if text is None:
            text = tokenizer.decode([tid], skip_special_tokens=False)
        return TokenLogprob(tid, text, _clamp(lp.logprob), lp.rank)

    rows = []
    for tid, entry in zip(token_ids, entries):
        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
        rows.append((item(tid, entry.get(tid, Logprob(-math.inf))), [item(t, v) for t, v in top]))
    return rows


# ---------------------------------------------------------------- printing


def _json_output(prompt: Prompt, out: Any, k: int | None, tokenizer: Any,
                 chat: bool) -> dict[str, Any]:
    completions = []
    for c in out.outputs:
        item: dict[str, Any] = {"text": c.text, "token_ids": c.token_ids,
                                "finish_reason": c.finish_reason}
        if k is not None:
            item["cumulative_logprob"] = _clamp(c.cumulative_logprob)
            item["logprobs"] = [
                {**sampled.as_json(), "top_logprobs": [t.as_json() for t in top]}
                for sampled, top in token_logprobs(c.token_ids, c.logprobs, k, tokenizer)]
        completions.append(item)
    obj: dict[str, Any] = {"prompt": prompt.seen}
    if chat:
        obj["messages"] = [{"role": "user", "content": prompt.given}]
    obj["completions"] = completions
    return obj


def _text_output(prompt: Prompt, out: Any, k: int | None, tokenizer: Any, chat: bool) -> str:
    lines = []
    template = " (chat template applied)" if chat else ""
    for c in out.outputs:
        lines.append(f"--- prompt: {prompt.given!r}{template} "
                     f"[{c.finish_reason}, {len(c.token_ids)} tokens]")
        lines.append(prompt.seen + c.text)
        if k is not None:
            lines += _logprob_lines(c, k, tokenizer)
    return "\n".join(lines)


def _logprob_lines(c: Any, k: int, tokenizer: Any) -> list[str]:
    head = f"--- logprobs (cumulative {_clamp(c.cumulative_logprob):.4f})"
    head += f": sampled token, then the top {k}" if k else ": sampled token"
    lines = [head]
    for i, (sampled, top) in enumerate(token_logprobs(c.token_ids, c.logprobs, k, tokenizer)):
        line = f"{i:>4} {sampled.token!r:>16} {sampled.logprob:9.4f}"
        if top:
            line += "  | " + "  ".join(f"{t.token!r} {t.logprob:.4f}" for t in top)
        lines.append(line)
    return lines
