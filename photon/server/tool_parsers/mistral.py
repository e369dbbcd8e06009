"""mistral: content, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`
(Mistral 7B Instruct v0.3 and other models with the pre-v11 tool-call format). `[TOOL_CALLS]` is a
special token, so the text keeps special tokens while this parser reads it. A malformed array is
returned as content, marker included."""

from __future__ import annotations

from photon.server.tool_parsers.base import (
    Region,
    ToolParser,
    held_back,
    register_tool_parser,
    sequence_regions,
)
from photon.server.tool_parsers.json_scan import SequenceFormat

TOOL_CALLS = "[TOOL_CALLS]"
_FORMAT = SequenceFormat(separator=",", arg_keys=("arguments",), opener="[", closer="]")
_ALPHANUMERIC = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    keep_special_tokens = True

    def regions(self, text: str, final: bool) -> list[Region]:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return [text if final else held_back(text, TOOL_CALLS)]
        return [text[:start], *sequence_regions(text, start, start + len(TOOL_CALLS), _FORMAT,
                                                final)]

    def make_id(self) -> str:
        """Mistral's chat templates require tool call ids of 9 letters and digits."""
        import secrets

        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
