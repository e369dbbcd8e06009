"""The reasoning-parser interface, its registry, and the splitter every parser shares.

A parser describes its output as a few phases (`Phase`): each sends its text to `reasoning` or to
`content` and ends at one of its tags, which moves to another phase; the tags themselves are
dropped. `ReasoningSplitter` walks them over text fed in pieces (a stream's deltas) and the whole
output alike: `split(text)` is one `feed(text, final=True)`, so a stream's pieces always add up to
the non-streamed split. A piece that ends with the beginning of a tag holds that beginning back
until the next piece (or the final one) says whether the tag follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from photon.registry import Registry

REASONING, CONTENT = "reasoning", "content"


class TokenLookup(Protocol):
    def token_to_id(self, token: str) -> int | None: ...


@dataclass(frozen=True)
class Phase:
    sink: str  # REASONING or CONTENT: where this phase's text goes
    exits: tuple[tuple[str, int], ...] = ()  # (tag, next phase): the first tag found wins


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output has no reasoning part
    content: str


class ReasoningParser:
    """Base of the parsers: `start_token` / `end_token` delimit the think block and must each be
    one token of the model's vocabulary (the engine watches for `end_token_id`)."""

    name: ClassVar[str]
    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"
    phases: ClassVar[tuple[Phase, ...]]  # the output starts in phases[0]

    def __init__(self, tokenizer: TokenLookup) -> None:
        missing = [t for t in (self.start_token, self.end_token) if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"the {self.name} reasoning parser needs {' and '.join(missing)} as "
                             f"single tokens of the model's vocabulary; this tokenizer has no such "
                             f"token")
        self.start_token_id = int(tokenizer.token_to_id(self.start_token))  # type: ignore[arg-type]
        self.end_token_id = int(tokenizer.token_to_id(self.end_token))  # type: ignore[arg-type]

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the reasoning is over at the end of `token_ids` (as vLLM: the last think tag
        in them is an end tag). A prompt whose template closed the think block (Qwen3 with
        enable_thinking=false) starts the output past the reasoning."""
        for tid in reversed(token_ids):
            if tid == self.start_token_id:
                return False
            if tid == self.end_token_id:
                return True
        return False

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.phases)

    def split(self, text: str) -> ReasoningSplit:
        splitter = self.splitter()
        delta = splitter.feed(text, final=True)
        return ReasoningSplit(delta.reasoning if splitter.reasoning_seen else None, delta.content)


class ReasoningSplitter:
    """The split of one output, fed piece by piece."""

    def __init__(self, phases: tuple[Phase, ...]) -> None:
        self.phases = phases
        self.phase = 0
        self.reasoning_seen = phases[0].sink == REASONING
        self._held = ""  # the start of a possible tag, not yet attributed

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        """The reasoning and content text that `text` adds; `final`: nothing follows (a held tag
        beginning is text after all)."""
        out = ReasoningDelta()
        pending, self._held = self._held + text, ""
        while pending:
            phase = self.phases[self.phase]
            found = _first_tag(pending, phase.exits)
            if found is None:
                keep = 0 if final else _tag_prefix_len(pending, phase.exits)
                self._emit(out, phase.sink, pending[:len(pending) - keep])
                self._held = pending[len(pending) - keep:]
                break
            at, tag, nxt = found
            self._emit(out, phase.sink, pending[:at])
            pending = pending[at + len(tag):]
            self.phase = nxt
            self.reasoning_seen |= self.phases[nxt].sink == REASONING
        return out

    @staticmethod
    def _emit(out: ReasoningDelta, sink: str, text: str) -> None:
        if sink == REASONING:
            out.reasoning += text
        else:
            out.content += text


def _first_tag(text: str, exits: tuple[tuple[str, int], ...]) -> tuple[int, str, int] | None:
    best: tuple[int, str, int] | None = None
    for tag, nxt in exits:
        at = text.find(tag)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, tag, nxt)
    return best


def _tag_prefix_len(text: str, exits: tuple[tuple[str, int], ...]) -> int:
    """The longest end of `text` that is a proper beginning of one of the tags."""
    longest = 0
    for tag, _ in exits:
        for k in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:k]):
                longest = k
                break
    return longest


ParserClass = type[ReasoningParser]
_PARSERS: Registry[ParserClass] = Registry("reasoning parser")
register_reasoning_parser = _PARSERS.register
reasoning_parser_names = _PARSERS.names
get_reasoning_parser = _PARSERS.get
