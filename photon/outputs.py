"""RequestOutput / CompletionOutput, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """A token's log probability; `rank` is 1-based (1 = the most likely token) and
    `decoded_token` its text (None when the request does not detokenize)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per token: the token itself and the top ones asked for, by token id.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Engine-side timestamps (time.monotonic()) of a request, for serving metrics."""

    arrival_time: float  # when EngineCore.add_request created it
    first_scheduled_time: float | None = None  # first admission into a running batch
    first_token_time: float | None = None  # commit of the first output token (any child)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache
    error: str | None = None  # set when the request failed (its outputs end with "abort")
    # Disaggregation: on a prefill instance (kv_role kv_producer), where a decode instance finds
    # this request's KV cache; send it on as the decode request's kv_transfer_params.
    kv_transfer_params: dict[str, Any] | None = None
