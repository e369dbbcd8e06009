"""The `<think> ... </think>` parsers, with vLLM's names and semantics.

- qwen3: reasoning only inside an explicit `<think>` block; an output without one is all content
  (Qwen3 with enable_thinking=false: the template put an empty think block in the prompt).
- deepseek_r1: everything before `</think>` is reasoning, `<think>` or not (DeepSeek-R1's template
  opens the block in the prompt); a leading `<think>` the model writes itself is dropped.

Either way an output that stops inside the block (max_tokens) is all reasoning, streamed or not.
"""

from __future__ import annotations

from photon.reasoning.base import (
    CONTENT,
    REASONING,
    Phase,
    ReasoningParser,
    register_reasoning_parser,
)

_START, _END = ReasoningParser.start_token, ReasoningParser.end_token


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    phases = (Phase(CONTENT, ((_START, 1),)),
              Phase(REASONING, ((_END, 2),)),
              Phase(CONTENT))


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    phases = (Phase(REASONING, ((_START, 1), (_END, 2))),
              Phase(REASONING, ((_END, 2),)),
              Phase(CONTENT))
