"""Reasoning parsers (`--reasoning-parser qwen3|deepseek_r1`, vLLM's names): a reasoning model's
think block goes to `reasoning_content`, the rest to `content`; and the engine starts a request's
structured-output grammar only once the reasoning ended (`ReasoningParser.end_token_id`)."""

from __future__ import annotations

from photon.reasoning import think as _think  # noqa: F401 - registers the parsers
from photon.reasoning.base import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    ReasoningSplitter,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

__all__ = ["ReasoningDelta", "ReasoningParser", "ReasoningSplit", "ReasoningSplitter",
           "get_reasoning_parser", "reasoning_parser_names", "register_reasoning_parser"]
