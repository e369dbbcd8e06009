"""StructuredOutputsParams: what a request's output must match (vLLM's names and shapes).

Exactly one kind is given: `json` (a JSON schema, dict or string), `json_object` (any JSON object),
`regex`, `choice` (one of a list of strings) or `grammar` (EBNF, the GBNF dialect of llama.cpp).

Whitespace in JSON output is bounded by default: the grammar allows no free whitespace (compact
separators, as `json.dumps` writes with `(", ", ": ")`), so a model cannot spin in whitespace until
`max_tokens`. `any_whitespace=True` allows free whitespace between JSON elements; give
`max_whitespace` (a run length) with it to keep that bounded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _fail(message: str) -> None:
    raise ValueError(f"structured_outputs: {message}")


@dataclass
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    any_whitespace: bool = False
    max_whitespace: int | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            _fail(f"give exactly one of {', '.join(KINDS)}; got "
                  f"{', '.join(given) if given else 'none'}")
        self._check_values()

    def _check_values(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                _fail(f"json must be a JSON schema (an object), got invalid JSON: {e}")
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            _fail(f"json must be a JSON schema object, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(f"{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                _fail(f"choice must be a list of strings, got {self.choice!r:.80}")
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                _fail("choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.max_whitespace is not None and (
                not isinstance(self.max_whitespace, int) or self.max_whitespace < 1):
            _fail(f"max_whitespace must be an integer >= 1, got {self.max_whitespace!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool, int | None]:
        """Cache key of the compiled grammar: equal specs compile once. Its text (a JSON schema
        or choice list as compact JSON, else the regex or grammar) is what the size limit bounds."""
        kind = self.kind
        value = getattr(self, kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True,
                                                               separators=(",", ":"))
        return kind, text, self.any_whitespace, self.max_whitespace


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on what one request may ask to compile: compile cost grows with the spec (for some
    grammars faster than linearly), so an unbounded spec could hold a compile thread and its
    memory for as long as it likes. 0 disables a limit (the engine's values:
    StructuredOutputsConfig.limits)."""

    max_chars: int  # the spec's text: JSON schema (compact JSON), regex, grammar, choices
    max_choices: int

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raise ValueError naming the limit, the value and the engine argument that sets it."""
        if spec.choice is not None and 0 < self.max_choices < len(spec.choice):
            _fail(f"choice has {len(spec.choice):,} entries; at most {self.max_choices:,} are "
                  f"allowed (structured_outputs_max_choices)")
        size = len(spec.key()[1])
        if 0 < self.max_chars < size:
            _fail(f"{spec.kind} is {size:,} characters long; at most {self.max_chars:,} are "
                  f"allowed (structured_outputs_max_chars)")
