"""Tool parsers: the base class, the registry and the two ways to read a model's output.

A parser splits the generated text into regions, in order: plain content (a string) and call
regions (`CallRegion`). `extract` reads a finished text; `ToolCallStream` reads it as it grows
and yields OpenAI deltas: content outside the calls, and per call index first the id, type and
name, then the arguments text as it arrives. The deltas, concatenated per index, equal what
`extract` returns for the same text, except for a call that was announced and then turned out
malformed (the stream cannot take it back; `extract` returns such a call region as content).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from photon.registry import Registry
from photon.server.tool_parsers.json_scan import CallScan, SequenceFormat, scan_sequence


@dataclass
class CallRegion:
    raw: str  # the text the calls were read from, markers included (content if `bad`)
    scans: list[CallScan] = field(default_factory=list)
    bad: bool = False  # malformed: `raw` is returned as content


Region = str | CallRegion


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]


class ToolParser:
    """Reads one model family's tool-call text format. Stateless: streaming state lives in
    `ToolCallStream`, so one instance serves every request."""

    name: ClassVar[str] = ""
    # The call marker is a special token: the text must keep special tokens to see it.
    keep_special_tokens: ClassVar[bool] = False

    def regions(self, text: str, final: bool) -> list[Region]:
        """`text` split into content and call regions. While not `final`, content that may
        still become part of a marker is left out (it comes back once it is known)."""
        raise NotImplementedError

    def make_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def extract(self, text: str, max_calls: int | None = None) -> ExtractedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        for region in self.regions(text, final=True):
            if isinstance(region, str):
                content.append(region)
            elif region.bad:
                content.append(region.raw)
            else:
                calls += [ToolCall(self.make_id(), s.name or "", s.args or "")
                          for s in region.scans]
        joined = "".join(content)
        return ExtractedToolCalls(joined or None, calls[:max_calls])


_PARSERS: Registry[type[ToolParser]] = Registry("tool call parser")


register_tool_parser = _PARSERS.register
tool_parser_names = _PARSERS.names


def get_tool_parser(name: str) -> ToolParser:
    """An instance of the registered parser `name`; ValueError listing the known names."""
    return _PARSERS.get(name)()


def held_back(text: str, marker: str) -> str:
    """`text` without a trailing proper prefix of `marker` (it may be the marker's start)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def sequence_regions(text: str, raw_start: int, scan_start: int, fmt: SequenceFormat,
                     final: bool) -> list[Region]:
    """The call region of a sequence of calls read from text[scan_start:] (its raw text begins
    at raw_start, markers included), then the content after it (leading whitespace dropped)."""
    seq = scan_sequence(text, scan_start, fmt, final)
    if seq.bad:
        return [CallRegion(text[raw_start:], seq.calls, bad=True)]
    if seq.end is None:
        return [CallRegion(text[raw_start:], seq.calls)]
    return [CallRegion(text[raw_start:seq.end], seq.calls), text[seq.end:].lstrip()]
