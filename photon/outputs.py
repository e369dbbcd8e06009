"""RequestOutput / CompletionOutput, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Engine-side timestamps (time.monotonic()) of a request, for serving metrics."""

    arrival_time: float  # when EngineCore.add_request created it
    first_scheduled_time: float | None = None  # first admission into a running batch


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request failed (its outputs end with "abort")
