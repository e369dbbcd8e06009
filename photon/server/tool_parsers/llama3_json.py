"""llama3_json: the output is one JSON call `{"name": ..., "parameters": {...}}` (or
"arguments"), or several separated by `;`, optionally after `<|python_tag|>` (Llama 3.1-3.3
with JSON tool calling). Output that does not start with a call is content; so is a call
sequence that turns out malformed (all of it, as written)."""

from __future__ import annotations

from photon.server.tool_parsers.base import (
    Region,
    ToolParser,
    register_tool_parser,
    sequence_regions,
)
from photon.server.tool_parsers.json_scan import SequenceFormat, skip_ws

PYTHON_TAG = "<|python_tag|>"
_FORMAT = SequenceFormat(separator=";", arg_keys=("parameters", "arguments"))


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def regions(self, text: str, final: bool) -> list[Region]:
        start = skip_ws(text, 0)
        rest = text[start:]
        if not final and PYTHON_TAG.startswith(rest):
            return []  # undecided: this may still open a call
        if rest.startswith(PYTHON_TAG):
            start += len(PYTHON_TAG)
        if not text.startswith("{", skip_ws(text, start)):
            if not final and skip_ws(text, start) == len(text):
                return []  # the tag, and the call not yet begun
            return [text]
        return sequence_regions(text, 0, start, _FORMAT, final)
