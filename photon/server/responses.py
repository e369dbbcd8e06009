"""Pieces of the OpenAI responses both endpoints build: usage, logprob entries, the state of a
choice across a stream's deltas, kv_transfer_params on the response."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from photon.outputs import Logprob, RequestOutput, SampleLogprobs

if TYPE_CHECKING:
    from photon.server.openai_serving import Run

_MIN_LOGPROB = -9999.0  # -inf is not JSON


def clamp_logprob(value: float) -> float:
    value = float(value)
    return value if value == value and value > _MIN_LOGPROB else _MIN_LOGPROB


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) of a logprob entry, best first."""
    return sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda kv: -kv[1])[:k]


def token_logprob(entry: dict[int, Logprob], token_id: int) -> float:
    lp = entry.get(token_id)
    return lp.logprob if lp is not None else float("-inf")


def with_kv_transfer_params(body: dict[str, Any], run: Run) -> dict[str, Any]:
    """`body` with the run's kv_transfer_params (vLLM's response field), once the engine returned
    them: in a full response, and in a stream from the chunk of the final output on."""
    if run.kv_transfer_params is not None:
        body["kv_transfer_params"] = run.kv_transfer_params
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class ChoiceState:
    """What one choice (prompt index x sample index) has received so far."""

    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False  # a streaming choice has sent its first chunk (chat: the role)

    def add(self, token_ids: list[int], logprobs: SampleLogprobs | None, text: str,
            finish_reason: str | None, stop_reason: int | str | None) -> None:
        self.text += text
        self.num_tokens += len(token_ids)
        self.token_ids = (self.token_ids or []) + list(token_ids)
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(logprobs)
        if finish_reason is not None:
            self.finish_reason = finish_reason
            self.stop_reason = stop_reason


def choice_updates(tag: int, out: RequestOutput, n: int
                   ) -> list[tuple[int, Any]]:
    """(choice index, CompletionOutput) for each child with news in this delta output."""
    return [(tag * n + c.index, c) for c in out.outputs
            if c.token_ids or c.text or c.finish_reason is not None]
