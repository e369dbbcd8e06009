"""The engine's RequestOutputs: built from a request's children, cumulative or as deltas.

A request added with `delta=True` gets, at each step it is touched, only what changed since its
last output (`DeltaState` remembers what was sent); otherwise every output carries everything so
far. The engine core owns the per-request state and calls `request_output`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from photon.engine.request import Request
from photon.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput


@dataclass
class DeltaState:
    """What the outputs of a request added with `delta=True` already sent."""

    sent_tokens: list[int]  # per child: output tokens already reported
    finish_sent: list[bool]
    prompt_logprobs_sent: bool = False  # delivered once, in the first output after they are done


def request_output(parent_id: str, children: list[Request], state: DeltaState | None
                   ) -> RequestOutput:
    """The output of request `parent_id` (its children: n > 1 sequences): cumulative, or
    what changed since the last one when `state` tracks what was sent."""
    first = children[0]
    if state is not None:
        outs = [delta_output(r, state) for r in children]
    else:
        outs = cumulative_outputs(children)
    metrics = RequestMetrics(first.arrival_time, _earliest(r.scheduled_time for r in children),
                             _earliest(r.first_token_time for r in children))
    error = next((r.error for r in children if r.error is not None), None)
    # Delta outputs go out every step: share the prompt ids instead of copying them each time.
    prompt_ids = first.prompt_token_ids if state is not None else list(first.prompt_token_ids)
    return RequestOutput(parent_id, first.prompt, prompt_ids, outs,
                         finished=all(r.finished for r in children), metrics=metrics,
                         prompt_logprobs=prompt_logprobs(first, state),
                         num_cached_tokens=first.num_cached_tokens, error=error,
                         kv_transfer_params=first.kv_transfer_params_out)


def _earliest(times: Iterable[float | None]) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


def prompt_logprobs(first: Request, state: DeltaState | None) -> PromptLogprobs | None:
    """Once complete: every time, or once in delta mode."""
    if first.prompt_logprobs is None or not first.prompt_logprobs_done:
        return None
    if state is None:
        return list(first.prompt_logprobs)
    if state.prompt_logprobs_sent:
        return None
    state.prompt_logprobs_sent = True
    return first.prompt_logprobs


def delta_output(r: Request, state: DeltaState) -> CompletionOutput:
    start, end = state.sent_tokens[r.index], len(r.output_token_ids)
    state.sent_tokens[r.index] = end
    finish = None
    if r.finished and not state.finish_sent[r.index]:
        state.finish_sent[r.index] = True
        finish = r.finish_reason.value if r.finish_reason else None
    want_lp = r.params.logprobs is not None
    return CompletionOutput(
        index=r.index,
        text=r.detokenizer.get_delta(finished=r.finished) if r.detokenizer else "",
        token_ids=r.output_token_ids[start:end],
        cumulative_logprob=r.cumulative_logprob if want_lp else None,
        logprobs=r.logprobs[start:end] if want_lp else None,
        finish_reason=finish,
        stop_reason=r.stop_reason if finish else None,
    )


def cumulative_outputs(children: list[Request]) -> list[CompletionOutput]:
    return [CompletionOutput(
        index=r.index,
        text=r.detokenizer.output_text if r.detokenizer else "",
        token_ids=list(r.output_token_ids),
        cumulative_logprob=r.cumulative_logprob if r.params.logprobs is not None else None,
        logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
        finish_reason=r.finish_reason.value if r.finish_reason else None,
        stop_reason=r.stop_reason,
    ) for r in children]
