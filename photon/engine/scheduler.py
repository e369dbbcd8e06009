"""Scheduler: owns the request queues and every request counter.

plan() builds the next step's batch assuming every running request continues (its newest token may
still be on the device: a placeholder the model runner reads from the token pool). commit() applies
one step's sampled tokens: appends them, runs stop checks, finalizes finished requests, and drops
the step's in-flight references, releasing resources of finalized requests that reach zero.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from photon.config import SchedulerConfig
from photon.engine.kv_cache import KVCacheManager, PrefixMatch
from photon.engine.logprobs import TokenText, logprob_entry
from photon.engine.request import FinishReason, Request, RequestStatus
from photon.structured.backend import GrammarError


@dataclass(slots=True)
class ScheduledRow:
    request: Request
    start: int  # first position computed this step
    num_tokens: int
    sample: bool  # the row reaches the request's known length: sample its next token
    out_index: int  # output index of the sampled token (seeds the counter-based RNG)
    block_ids: list[int]  # the request's blocks (read-only view owned by the KV manager)

    @property
    def seq_len(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.rows


@dataclass(slots=True)
class CommittedToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None  # 1-based rank of the token in the raw distribution
    top_ids: list[int] | None = None  # the top alternatives, most likely first
    top_logprobs: list[float] | None = None


@dataclass(slots=True)
class PromptScores:
    """Logprobs of `request`'s prompt tokens [first, first + len(logprobs)), from one step."""

    request: Request
    first: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]  # [] per token when no top logprobs were asked for
    top_logprobs: list[list[float]]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 on_release: Callable[[Request], None], token_text: TokenText | None = None
                 ) -> None:
        self.config = config
        self.token_text = token_text  # a token's text, for logprob entries (None: no text)
        self.kv = kv
        self.on_release = on_release  # frees what the model runner holds (token-pool row)
        self.waiting: deque[Request] = deque()
        self.grammar_waiting: list[Request] = []  # grammar still compiling: not admissible yet
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every request not yet released
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if request.grammar is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.grammar_waiting.append(request)
        else:
            self.waiting.append(request)

    def promote_grammars(self) -> list[Request]:
        """Move requests whose grammar compiled into `waiting`; finalize (ABORT, with `error`)
        those whose grammar failed or timed out and return them. Others keep compiling."""
        failed: list[Request] = []
        for req in list(self.grammar_waiting):
            try:
                ready = req.grammar.poll()
            except GrammarError as e:
                req.error = str(e)
                self.finalize(req, FinishReason.ABORT)
                failed.append(req)
                continue
            if ready:
                self.grammar_waiting.remove(req)
                req.status = RequestStatus.WAITING
                self.waiting.append(req)
        return failed

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.finalized:
            return None
        self.finalize(req, FinishReason.ABORT)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.grammar_waiting)

    @property
    def only_compiling(self) -> bool:
        """Nothing to plan: every unfinished request waits for its grammar."""
        return bool(self.grammar_waiting) and not self.waiting and not self.running

    @property
    def num_unreleased(self) -> int:
        return len(self.requests)

    # ---- plan ---------------------------------------------------------------------------------
    def plan(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        running = RequestStatus.RUNNING
        for req in list(self.running):  # a copy: preemption edits the list
            if budget == 0:
                break
            # Inlined Request.num_planned_outputs / num_known_tokens: this loop runs for every
            # running request every step.
            n_out = len(req.output_token_ids) + req.num_pending
            if req.status is not running or n_out >= req.max_tokens:
                continue  # preempted this step, or every output already sampled
            known = len(req.prompt_token_ids) + n_out
            num_new = min(known - req.num_computed_tokens, budget)
            if num_new > 0 and self._reserve(req, num_new):
                self._add_row(req, num_new, out)
                budget -= num_new
        self._admit_waiting(budget, out)
        return out

    def _reserve(self, req: Request, num_new: int) -> bool:
        """KV blocks for the row, preempting lower-priority requests if needed."""
        while not self.kv.allocate(req.request_id, req.num_computed_tokens + num_new):
            victim = self._pick_victim(req)
            self.preempt(victim)
            if victim is req or not victim.released:
                return False  # blocks come back once the victim's in-flight step commits
        return True

    def _pick_victim(self, req: Request) -> Request:
        """Lowest-priority running request not yet planned this step (they come after `req`);
        `req` itself when there is none."""
        later = self.running[self.running.index(req) + 1:]
        for cand in reversed(later):
            if cand.status is RequestStatus.RUNNING:
                return cand
        return req

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.inflight_refs > 0:
                break  # a preempted request whose last step is still in flight (FCFS: wait)
            # Prompt logprobs need the logits of every prompt position: no cached prefix.
            prefix = (self.kv.match_prefix(req.all_token_ids) if req.prompt_logprobs_done
                      else PrefixMatch())
            num_new = min(req.num_known_tokens - prefix.num_tokens, budget)
            if not self.kv.allocate(req.request_id, prefix.num_tokens + num_new, prefix):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.released = False
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
                req.num_cached_tokens = prefix.num_tokens
            req.num_computed_tokens = prefix.num_tokens
            self.running.append(req)
            self._add_row(req, num_new, out)
            budget -= num_new

    def _add_row(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        start = req.num_computed_tokens
        sample = start + num_new == req.num_known_tokens
        out.rows.append(ScheduledRow(req, start, num_new, sample, req.num_planned_outputs,
                                    self.kv.block_table(req.request_id)))
        out.num_tokens += num_new
        req.num_computed_tokens += num_new
        req.num_pending += int(sample)
        req.inflight_refs += 1  # the launch reference, dropped by commit()

    def preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the KV (once nothing in flight reads it), requeue."""
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._maybe_release(req)

    # ---- commit -------------------------------------------------------------------------------
    def commit(self, rows: list[ScheduledRow], tokens: list[CommittedToken | None]) -> list[Request]:
        """Apply one step's results; return the requests that got a token or were finalized."""
        touched: list[Request] = []
        for row, tok in zip(rows, tokens):
            req = row.request
            if row.sample:
                req.num_pending -= 1
                if not req.finalized and tok is not None:
                    self._append(req, tok)
                    touched.append(req)
            req.inflight_refs -= 1
            if req.status is RequestStatus.RUNNING:
                known = min(req.num_computed_tokens,
                            len(req.prompt_token_ids) + len(req.output_token_ids))
                if self.kv.needs_publish(req.request_id, known):
                    self.kv.cache_blocks(req.request_id, req.all_token_ids, known)
            elif req.inflight_refs == 0:
                self._maybe_release(req)  # only preempted or finished requests release
        return touched

    def add_prompt_logprobs(self, scores: list[PromptScores]) -> None:
        """Append a step's prompt logprobs; tokens already collected (scored again by the
        recompute of a preempted request) are skipped."""
        for s in scores:
            req = s.request
            if req.prompt_logprobs is None:
                continue
            text = self._text_for(req)
            for j, lp in enumerate(s.logprobs):
                if s.first + j == len(req.prompt_logprobs):
                    req.prompt_logprobs.append(logprob_entry(
                        req.prompt_token_ids[s.first + j], lp, s.ranks[j], s.top_ids[j],
                        s.top_logprobs[j], text))

    def _text_for(self, req: Request) -> TokenText | None:
        return self.token_text if req.params.detokenize else None

    def _append(self, req: Request, tok: CommittedToken) -> None:
        req.output_token_ids.append(tok.token_id)
        if tok.logprob is not None:
            req.cumulative_logprob += tok.logprob
            req.logprobs.append(logprob_entry(tok.token_id, tok.logprob, tok.rank or 0,
                                              tok.top_ids or (), tok.top_logprobs or (),
                                              self._text_for(req)))
        stop_str = req.detokenizer.update(tok.token_id) if req.detokenizer else None
        grammar_done = req.grammar is not None and req.grammar.terminated
        reason = FinishReason.STOP if grammar_done else self._check_stop(req, tok.token_id,
                                                                          stop_str)
        if reason is not None:
            self.finalize(req, reason)

    def reject_grammars(self, requests: list[Request]) -> None:
        """Their matchers refused the token commit appended. The mask makes that impossible, so
        it is an engine bug: the request ends (ABORT, with `error`) instead of the engine."""
        for req in requests:
            self.fail(req, f"internal error: the grammar rejected sampled token "
                           f"{req.output_token_ids[-1]}")

    def fail(self, req: Request, error: str) -> None:
        """End `req` with ABORT and `error`, also when it was already finalized (its output must
        not look complete); the other requests go on."""
        req.error = error
        if req.finalized:
            req.finish_reason = FinishReason.ABORT
        else:
            self.finalize(req, FinishReason.ABORT)

    def fail_grammars(self, error: str) -> list[Request]:
        """The grammar executor failed (its worker died): no matcher state is left, so every
        unfinished request with a grammar ends (ABORT, with `error`); the others go on."""
        failed = [r for r in (*self.running, *self.waiting) if r.grammar is not None]
        for req in failed:
            req.error = error
            self.finalize(req, FinishReason.ABORT)
        return failed

    def _check_stop(self, req: Request, token_id: int, stop_str: str | None) -> FinishReason | None:
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

    def finalize(self, req: Request, reason: FinishReason) -> None:
        """The request's output is final now; its rows still in flight become zombies."""
        req.finalized = True
        req.finish_reason = reason
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING_FOR_GRAMMAR:
            self.grammar_waiting.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        self._maybe_release(req)

    def _maybe_release(self, req: Request) -> None:
        """Invariant: KV blocks and the pool row are released only when nothing in flight reads them.
        A preempted request may already be released when it is finalized (aborted while waiting):
        then only its bookkeeping entry goes."""
        if req.inflight_refs > 0:
            return
        if req.status not in (RequestStatus.PREEMPTED, RequestStatus.FINISHED):
            return
        if not req.released:
            self.kv.free(req.request_id)
            self.on_release(req)
            req.released = True
        if req.finalized:
            self.requests.pop(req.request_id, None)
            if req.grammar is not None:
                req.grammar.release()
