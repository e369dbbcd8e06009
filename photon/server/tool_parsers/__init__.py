"""Tool-call parsers (`--tool-call-parser NAME`, vLLM's names): read a model family's tool-call
text into OpenAI `tool_calls`. Add one by subclassing `ToolParser` and decorating it with
`@register_tool_parser("name")`."""

from __future__ import annotations

from photon.server.tool_parsers import hermes, llama3_json, mistral  # noqa: F401 - register
from photon.server.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)
from photon.server.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from photon.server.tool_parsers.stream import StreamDelta, ToolCallStream

__all__ = ["ExtractedToolCalls", "NamedCallParser", "RequiredCallsParser", "StreamDelta",
           "ToolCall", "ToolCallStream", "ToolParser", "get_tool_parser", "register_tool_parser",
           "tool_parser_names"]
