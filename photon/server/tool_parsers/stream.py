"""ToolCallStream: a parser's reading of a growing text, as OpenAI chat-completion deltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from photon.server.tool_parsers.base import CallRegion, ToolParser
from photon.server.tool_parsers.json_scan import CallScan


@dataclass
class _Announced:
    id: str
    region: int  # the ordinal of the call region it was read from
    args_sent: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallStream:
    """Feed the text deltas of one choice; each call returns what is new since the last one.
    Calls are announced in order (index 0, 1, ...) once their name is complete; a call's
    arguments text follows as it arrives. `max_calls` drops calls beyond it."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.content_sent = ""
        self.calls: list[_Announced] = []

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str, final: bool) -> StreamDelta:
        self.text += delta
        out = StreamDelta()
        content: list[str] = []
        index = 0
        for ordinal, region in enumerate(self.parser.regions(self.text, final)):
            if isinstance(region, str):
                content.append(region)
                continue
            scans = self._scans(region, ordinal)
            if scans is None:
                content.append(region.raw)
                continue
            for scan in scans:
                if not self._call(index, ordinal, scan, out):
                    return self._with_content(out, content)
                index += 1
        return self._with_content(out, content)

    def _scans(self, region: CallRegion, ordinal: int) -> list[CallScan] | None:
        """The region's calls to stream; None when it is content (malformed before any of its
        calls was announced)."""
        if not region.bad:
            return region.scans
        announced = sum(1 for call in self.calls if call.region == ordinal)
        return region.scans[:announced] or None

    def _call(self, index: int, ordinal: int, scan: CallScan, out: StreamDelta) -> bool:
        """Add call `index`'s news to `out`; False when it cannot be announced yet (so nothing
        after it can be either)."""
        if self.max_calls is not None and index >= self.max_calls:
            return True
        args = scan.args or ""
        if index == len(self.calls):
            if scan.name is None:
                return False
            call = _Announced(self.parser.make_id(), ordinal, args)
            self.calls.append(call)
            out.tool_calls.append({"index": index, "id": call.id, "type": "function",
                                   "function": {"name": scan.name, "arguments": args}})
            return True
        call = self.calls[index]
        if len(args) > len(call.args_sent) and args.startswith(call.args_sent):
            out.tool_calls.append({"index": index,
                                   "function": {"arguments": args[len(call.args_sent):]}})
            call.args_sent = args
        return True

    def _with_content(self, out: StreamDelta, parts: list[str]) -> StreamDelta:
        content = "".join(parts)
        if content.startswith(self.content_sent):
            out.content = content[len(self.content_sent):]
            self.content_sent = content
        return out
