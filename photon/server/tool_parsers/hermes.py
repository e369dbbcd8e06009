"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes 2 Pro,
Qwen2.5, Qwen3). Text around the blocks is content; whitespace right after a block is dropped.
A block that is not one well-formed call is returned as content, tags included."""

from __future__ import annotations

from photon.server.tool_parsers.base import (
    CallRegion,
    Region,
    ToolParser,
    held_back,
    register_tool_parser,
)
from photon.server.tool_parsers.json_scan import scan_call

START, END = "<tool_call>", "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    def regions(self, text: str, final: bool) -> list[Region]:
        out: list[Region] = []
        pos, after_call = 0, False
        while True:
            start = text.find(START, pos)
            head = text[pos:] if start < 0 else text[pos:start]
            head = head.lstrip() if after_call else head
            if start < 0:
                out.append(head if final else held_back(head, START))
                return out
            out.append(head)
            end = text.find(END, start)
            out.append(_block(text, start, end, final))
            if end < 0:
                return out
            pos, after_call = end + len(END), True


def _block(text: str, start: int, end: int, final: bool) -> CallRegion:
    body_end = end if end >= 0 else len(text)
    body = text[start + len(START):body_end]
    scan = scan_call(body, 0, ("arguments",))
    raw = text[start:end + len(END)] if end >= 0 else text[start:]
    done = end >= 0 or final
    well_formed = scan.valid and not body[scan.end:].strip()
    return CallRegion(raw, [scan], bad=done and not well_formed)
