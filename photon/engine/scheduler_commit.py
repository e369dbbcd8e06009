"""The scheduler's commit side: a step's committed tokens, stop checks, finishing and releasing.

`Scheduler` (photon.engine.scheduler) plans; this half, a base class of it over the same state,
applies what a step produced: it appends each row's committed tokens with the stop checks,
finishes requests (their rows still in flight become zombies), drops the step's in-flight
references and releases what finished or preempted requests hold (KV blocks, the request index,
the LoRA slot) once nothing in flight reads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from photon.core.step import CommittedToken, PromptScores, ScheduledRow
from photon.engine.append import append_prompt_scores, append_token, check_stop
from photon.engine.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from collections import deque
    from collections.abc import Mapping

    from photon.engine.kv_cache import KVCacheManager
    from photon.engine.logprobs import TokenText
    from photon.engine.remote_kv import RemoteKV
    from photon.engine.scheduler import SchedulerOutput
    from photon.lora.slots import LoRASlotPool
    from photon.spec.adaptive import SpecPolicy


_NO_ENDS: dict[int, int] = {}  # never written


class SchedulerCommit:
    """The commit half of `Scheduler` (it owns the state; see its constructor)."""

    kv: KVCacheManager
    token_text: TokenText | None
    spec_policy: SpecPolicy | None
    remote: RemoteKV | None
    lora: LoRASlotPool | None
    waiting: deque[Request]
    grammar_waiting: list[Request]
    running: list[Request]
    requests: dict[int, Request]
    by_index: list[Request | None]
    free_indices: list[int]
    _released: list[int]

    def request_at(self, req_index: int) -> Request:
        req = self.by_index[req_index]
        assert req is not None, f"no request holds index {req_index}"
        return req

    def _spec_reserve(self, req: Request, bound: int) -> int:
        raise NotImplementedError

    def commit(self, step: SchedulerOutput, tokens: list[list[CommittedToken]],
               grammar_ended: Mapping[int, int] = _NO_ENDS) -> list[Request]:
        """Apply one step's results: per row its committed tokens (`grammar_ended`: by request
        index, the grammars that took their stop token, as which of the row's tokens); return
        the requests that got a token or were finished."""
        touched: list[Request] = []
        emitted = 0
        for row, req, toks in zip(step.plan.rows, step.requests, tokens):
            if row.sample:
                req.num_pending -= 1
                req.num_pending_max -= row.spec + 1
                if not req.finished and toks:
                    self._append_all(req, row, toks, grammar_ended.get(row.req_index, -1))
                    touched.append(req)
                    emitted += len(toks)
            req.inflight_refs -= 1
            if req.status is RequestStatus.RUNNING:
                self._after_commit(req, row.spec > 0)
            elif req.inflight_refs == 0:
                self._maybe_release(req)  # only preempted or finished requests release
        if self.spec_policy is not None and step.plan.rows:
            self.spec_policy.committed(step.plan.step, len(step.plan.rows), step.spec_k,
                                       step.decode_step, emitted)
        return touched

    def _append_all(self, req: Request, row: ScheduledRow, toks: list[CommittedToken],
                    grammar_end: int) -> None:
        """Append a row's tokens one by one with the stop checks; those after a stop are
        dropped (`grammar_end`: the index of the token that ended the grammar, or -1). A
        speculative row's accepted drafts had their K/V computed by it."""
        if row.speculative and req.status is RequestStatus.RUNNING:
            req.num_computed_tokens += len(toks) - 1
        grammar = req.grammar
        for i, tok in enumerate(toks):
            self._append(req, tok, i == grammar_end)
            if grammar is not None and tok.token_id == grammar.start_after:
                grammar.gate_passed = True
            if req.finished:
                break

    def _after_commit(self, req: Request, verified: bool) -> None:
        """Publish the committed, computed blocks; after a row that verified drafts, return the
        KV reserved past the new bound (only such a row reserves past it: a plain row reserves
        up to its end and the draft model's lookahead, which the bound keeps)."""
        committed = req.num_committed_tokens
        known = min(req.num_computed_tokens, committed)
        if self.kv.needs_publish(req.key, known):
            self.kv.cache_blocks(req.key, req.all_token_ids, known)
        if verified and req.spec_live:
            bound = self._spec_reserve(req, committed + req.num_pending_max)
            self.kv.shrink(req.key, max(bound, req.num_computed_tokens))

    def add_prompt_logprobs(self, scores: list[PromptScores]) -> None:
        for s in scores:
            req = self.request_at(s.req_index)  # held: the scored step is not committed yet
            if req.prompt_logprobs is not None:
                append_prompt_scores(req, s, self._text_for(req))

    def _text_for(self, req: Request) -> TokenText | None:
        return self.token_text if req.params.detokenize else None

    def _append(self, req: Request, tok: CommittedToken, grammar_ended: bool) -> None:
        stop_str = append_token(req, tok, self._text_for(req))
        reason = FinishReason.STOP if grammar_ended else check_stop(req, tok.token_id, stop_str)
        if reason is not None:
            self.finish(req, reason)

    def reject_grammars(self, requests: list[Request]) -> None:
        """Their matchers refused the token commit appended. The mask makes that impossible, so
        it is an engine bug: the request ends (ABORT, with `error`) instead of the engine."""
        for req in requests:
            self.fail(req, f"internal error: the grammar rejected sampled token "
                           f"{req.output_token_ids[-1]}")

    def fail(self, req: Request, error: str) -> None:
        """End `req` with ABORT and `error`, also when it was already finished (its output must
        not look complete); the other requests go on."""
        req.error = error
        if req.finished:
            req.finish_reason = FinishReason.ABORT
        else:
            self.finish(req, FinishReason.ABORT)

    def fail_grammars(self, error: str) -> list[Request]:
        """The grammar executor failed (its worker died): no matcher state is left, so every
        unfinished request with a grammar ends (ABORT, with `error`); the others go on."""
        failed = [r for r in (*self.running, *self.waiting) if r.grammar is not None]
        for req in failed:
            req.error = error
            self.finish(req, FinishReason.ABORT)
        return failed

    def finish(self, req: Request, reason: FinishReason) -> None:
        """The request's output is final now; its rows still in flight become zombies."""
        req.finished = True
        req.finish_reason = reason
        if self.remote is not None:
            computed = reason is not FinishReason.ABORT and req.output_token_ids != []
            self.remote.request_finished(req, computed)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING_FOR_GRAMMAR:
            self.grammar_waiting.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        self._maybe_release(req)

    def _maybe_release(self, req: Request) -> None:
        """Invariant: KV blocks, the request index and its LoRA slot are released only when
        nothing in flight reads them. A preempted request may already be released when it is finished (aborted
        while waiting): then only its bookkeeping entry goes."""
        if req.inflight_refs > 0:
            return
        if req.status not in (RequestStatus.PREEMPTED, RequestStatus.FINISHED):
            return
        if req.req_index is not None:
            if self.remote is None or not self.remote.hold_blocks(req):
                self.kv.free(req.key)
            self.by_index[req.req_index] = None
            self.free_indices.append(req.req_index)
            self._released.append(req.req_index)
            req.req_index = None
            if req.lora_slot:  # held with the index: no step in flight reads it now
                self.lora.release(req.lora_slot)
                req.lora_slot = 0
        elif req.kv_loaded:  # finished while its loaded blocks waited for admission
            self.kv.free(req.key)
            req.kv_loaded = False
        if req.finished:
            self.requests.pop(req.key, None)
            if req.grammar is not None:
                req.grammar.release()
