"""Tool calling in /v1/chat/completions, as vLLM does it.

`tool_choice` (default "auto" when `tools` are given, else "none"):
- "none": the tools are rendered into the prompt; the output is plain content.
- "auto": needs `--enable-auto-tool-choice` and `--tool-call-parser`; the parser reads calls
  out of the model's own text format.
- "required" / a named function: the output is constrained by a JSON schema through the
  structured-output path (a named function: its parameters object; "required": an array of
  `{"name": one of the tools, "parameters": that tool's schema}`), so the arguments are valid
  JSON for the function's schema.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from photon.server.errors import bad_request
from photon.server.protocol import ChatCompletionRequest, ChatTool, NamedToolChoice
from photon.server.tool_parsers import (
    NamedCallParser,
    RequiredCallsParser,
    ToolCallStream,
    ToolParser,
)
from photon.structured.params import StructuredOutputsParams

_EMPTY_OBJECT = {"type": "object", "properties": {}}
AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    '--tool-call-parser to be set')


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    template_tools: list[dict[str, Any]] | None = None  # the chat template's `tools`
    parser: ToolParser | None = None  # reads the output; None: plain content
    structured: StructuredOutputsParams | None = None  # the constraint of a forced choice
    max_calls: int | None = None  # 1 with parallel_tool_calls=false
    eos_texts: tuple[str, ...] = ()  # the end-of-sequence tokens' text

    @property
    def keep_special_tokens(self) -> bool:
        return self.parser is not None and self.parser.keep_special_tokens

    def output_text(self, text: str, finish: str | None) -> str:
        """The text the parser reads: while special tokens are kept (for the parser's marker),
        a final end-of-sequence token's text is not part of the answer."""
        if finish is not None and self.keep_special_tokens:
            for eos in self.eos_texts:
                if eos and text.endswith(eos):
                    return text[:-len(eos)]
        return text

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """vLLM's: "tool_calls" when auto made calls, or required finished normally."""
        if called and (self.mode == "auto" or (self.mode == "required" and reason == "stop")):
            return "tool_calls"
        return reason

    def reply(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The response message for a finished choice's text, and its finish_reason."""
        if self.parser is None:
            return {"role": "assistant", "content": text}, reason
        found = self.parser.extract(self.output_text(text, reason), self.max_calls)
        message: dict[str, Any] = {"role": "assistant", "content": found.content}
        if found.tool_calls:
            message["tool_calls"] = [c.to_dict() for c in found.tool_calls]
        return message, self.finish_reason(reason, bool(found.tool_calls))

    def stream(self) -> ToolCallStream | None:
        return None if self.parser is None else ToolCallStream(self.parser, self.max_calls)


def plan_tools(req: ChatCompletionRequest, auto_parser: ToolParser | None, enable_auto: bool,
               eos_texts: tuple[str, ...] = ()) -> ToolPlan:
    """The request's tool calling (mode "none" without tools); 400s for invalid combinations."""
    tools = req.tools or None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if tools is None:
        if choice != "none":
            raise bad_request("tool_choice needs tools: give the functions in `tools`",
                              "tool_choice")
        return ToolPlan("none")
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    max_calls = None if req.parallel_tool_calls else 1
    if choice == "none":
        return ToolPlan("none", rendered)
    if choice == "auto":
        if not enable_auto or auto_parser is None:
            raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan("auto", rendered, auto_parser, max_calls=max_calls, eos_texts=eos_texts)
    _check_no_structured(req)
    if isinstance(choice, NamedToolChoice):
        schema = _named_schema(tools, choice.function.name)
        parser: ToolParser = NamedCallParser(choice.function.name)
    else:
        schema, parser = _required_schema(tools, max_calls), RequiredCallsParser()
    try:
        structured = StructuredOutputsParams(json=schema)
    except ValueError as e:
        raise bad_request(str(e), "tools") from None
    mode = "required" if choice == "required" else "named"
    return ToolPlan(mode, rendered, parser, structured, max_calls)


def _check_no_structured(req: ChatCompletionRequest) -> None:
    formatted = req.response_format is not None and req.response_format.type != "text"
    if formatted or req.structured_outputs is not None:
        raise bad_request("tool_choice \"required\" or a named function constrains the output "
                          "itself; do not give response_format or structured_outputs with it",
                          "tool_choice")


def _named_schema(tools: list[ChatTool], name: str) -> dict[str, Any]:
    for tool in tools:
        if tool.function.name == name:
            return tool.function.parameters or _EMPTY_OBJECT
    names = ", ".join(t.function.name for t in tools)
    raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                      f"(given: {names})", "tool_choice")


def _required_schema(tools: list[ChatTool], max_calls: int | None) -> dict[str, Any]:
    """An array of calls, each `{"name": <a tool's name>, "parameters": <its schema>}`. `$defs`
    of the tools move to the top, where their `$ref`s ("#/$defs/...") point."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = copy.deepcopy(tool.function.parameters) or dict(_EMPTY_OBJECT)
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise bad_request(f"tools define $defs {key!r} differently; give the shared "
                                  f"definitions one meaning", "tools")
            defs[key] = value
        variants.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
            "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant `tool_calls` arguments arrive as JSON text; chat templates (Qwen, Llama,
    Mistral) render them as objects, so they get the parsed object (as vLLM does)."""
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls") or ()):
            function = call["function"]
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError as e:
                raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                                  f"valid JSON: {e}", "messages") from None
    return messages
