"""What commit does to one request with one token: append it (with its logprob entry and its
text for the stop strings) and decide whether the request stops. The scheduler owns the request
and calls these; they touch only the request's own output fields."""

from __future__ import annotations

import time

from photon.core.step import CommittedToken, PromptScores
from photon.engine.logprobs import TokenText, logprob_entry
from photon.engine.request import FinishReason, Request


def append_token(req: Request, tok: CommittedToken, text: TokenText | None) -> str | None:
    """Append `tok` to the request's output; return the stop string its text completed, if any
    (stop strings count only from min_tokens on)."""
    req.output_token_ids.append(tok.token_id)
    if req.first_token_time is None:
        req.first_token_time = time.monotonic()
    want = req.params.logprobs
    if want is not None and tok.logprob is not None:
        req.cumulative_logprob += tok.logprob
        req.logprobs.append(logprob_entry(tok.token_id, tok.logprob, tok.rank or 0,
                                          (tok.top_ids or ())[:want],
                                          (tok.top_logprobs or ())[:want], text))
    check = len(req.output_token_ids) >= req.params.min_tokens
    return req.detokenizer.update(tok.token_id, check) if req.detokenizer else None


def check_stop(req: Request, token_id: int, stop_str: str | None) -> FinishReason | None:
    """The finish reason after the request's newest token `token_id`, or None: EOS, stop ids and
    stop strings from min_tokens on (setting `stop_reason`), then max_tokens."""
    num_out = len(req.output_token_ids)
    if num_out >= req.params.min_tokens:
        if not req.params.ignore_eos and token_id in req.eos_token_ids:
            return FinishReason.STOP
        if token_id in req.params.stop_token_ids:
            req.stop_reason = token_id
            return FinishReason.STOP
        if stop_str is not None:
            req.stop_reason = stop_str
            return FinishReason.STOP
    if num_out >= req.max_tokens:
        return FinishReason.LENGTH
    return None


def append_prompt_scores(req: Request, s: PromptScores, text: TokenText | None) -> None:
    """Append one step's prompt logprobs; tokens already collected (scored again by the
    recompute of a preempted request) are skipped."""
    assert req.prompt_logprobs is not None
    for j, lp in enumerate(s.logprobs):
        if s.first + j == len(req.prompt_logprobs):
            req.prompt_logprobs.append(logprob_entry(
                req.prompt_token_ids[s.first + j], lp, s.ranks[j], s.top_ids[j],
                s.top_logprobs[j], text))
