"""Scheduler: owns the request queues and every request counter.

plan() builds the next step's batch assuming every running request continues (its newest token may
still be on the device: a placeholder the model runner reads from the token pool). commit() (the
base class photon.engine.scheduler_commit.SchedulerCommit) applies one step's committed tokens:
appends them, runs stop checks, finishes requests that stopped, and drops the step's in-flight
references, releasing what finished or preempted requests hold (KV blocks, their request index)
once they reach zero. Admitted requests get a request index; the plan tells
the runner which indices enter and leave its table (photon.core.step).

Speculative requests (`spec_k` K > 0, fixed at `add`) decode with speculative rows
(photon.core.step.ScheduledRow): a row adds 1 to K + 1 tokens, known only at its commit. For them
`num_computed_tokens` is a lower bound (each speculative row counts its one certain position;
commit adds the accepted drafts), `num_pending_max` bounds what the rows in flight add, and KV
blocks are reserved for the upper bound (committed + num_pending_max + K, capped at
max_model_len); commit returns the blocks past the new bound. In a step whose K_eff is 0 (the
adaptive switch), a speculative request whose length the host knows (no row in flight verifies
drafts) runs a plain row: the plain decode step, with nothing resolved on the device.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from photon.config import SchedulerConfig
from photon.core.step import (
    NewRequest,
    ScheduledRow,
    StepPlan,
    request_table_size,
)
from photon.engine.kv_cache import KVCacheManager, PrefixMatch
from photon.engine.logprobs import TokenText
from photon.engine.remote_kv import RemoteKV
from photon.engine.request import FinishReason, Request, RequestStatus
from photon.engine.scheduler_commit import SchedulerCommit
from photon.lora.slots import LoRASlotPool, SlotGate
from photon.spec.adaptive import SpecPolicy
from photon.structured.backend import GrammarError


@dataclass(slots=True)
class SchedulerOutput:
    """A planned step: the plan the runner receives and, aligned with it, the scheduler's own
    requests (its rows' and its new requests'), which commit and the grammar step read."""

    plan: StepPlan
    requests: list[Request] = field(default_factory=list)  # plan.rows[i] is requests[i]'s
    admitted: list[Request] = field(default_factory=list)  # plan.new_requests[i] is admitted[i]
    spec_k: int = 0  # K_eff: the drafts the step's speculative rows verify
    # A decode step whose time is a step time of its K_eff (the adaptive switch's measurement):
    # every row queries one token or verifies the step's K_eff drafts, and no speculative
    # request runs a plain row in a step with K_eff > 0 (it proposes drafts it did not verify).
    decode_step: bool = True


def speculates(req: Request, grammar_speculates: bool) -> bool:
    """Whether a request may speculate (when the engine does). A request with a grammar
    (structured outputs) does when the host can fill its mask at every verified position
    (`grammar_speculates`: the ngram method, whose drafts the host recomputes); otherwise it runs
    plain rows. min_tokens speculates: the sampler applies its stop-token bans per verified
    position from the device's output index."""
    return req.grammar is None or grammar_speculates


def _gated(req: Request) -> bool:
    """A grammar that starts after a token (the end of a reasoning block) not committed yet:
    its rows stay plain (the gate must open at a row's one token, where the next mask is the
    grammar's first)."""
    return req.grammar is not None and not req.grammar.gate_passed


class Scheduler(SchedulerCommit):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 token_text: TokenText | None = None, spec_k: int = 0,
                 max_model_len: int = 1 << 30, draft_lookahead: int = 0,
                 grammar_speculates: bool = False) -> None:
        self.config = config
        self.spec_k = spec_k  # num_speculative_tokens of speculative requests; 0: none
        self.grammar_speculates = grammar_speculates  # requests with a grammar speculate too
        # KV positions a draft model writes past a speculative request's sampling row: its K
        # single-token steps after the row (0: no draft model)
        self.draft_lookahead = draft_lookahead
        # Chooses each step's K_eff (photon.spec.adaptive); None: every step verifies K.
        self.spec_policy: SpecPolicy | None = None
        self.max_model_len = max_model_len
        # Requests admitted into the running batch at most (<= max_num_seqs; benchmarks lower it
        # to hold a batch size while more requests wait).
        self.max_running = config.max_num_seqs
        self.token_text = token_text  # a token's text, for logprob entries (None: no text)
        self.kv = kv
        size = request_table_size(config.max_num_seqs)
        self.free_indices = list(range(size - 1, -1, -1))
        self.by_index: list[Request | None] = [None] * size  # request index -> its request
        self._released: list[int] = []  # indices released since the last plan
        self.num_steps = 0  # non-empty plans so far
        self.waiting: deque[Request] = deque()
        self.grammar_waiting: list[Request] = []  # grammar still compiling: not admissible yet
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}  # every request not yet released, by key
        self._next_key = 0
        self.num_preemptions = 0
        # Prefill/decode disaggregation's state (set by the engine with a KV connector)
        self.remote: RemoteKV | None = None
        self.on_kv_failure = "recompute"  # kv_connector_extra_config.on_failure
        # The device's LoRA adapter slots (set by the engine with --enable-lora; None: none)
        self.lora: LoRASlotPool | None = None

    # ---- queue management -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.key = self._next_key
        self._next_key += 1
        request.spec_k = self.spec_k if speculates(request, self.grammar_speculates) else 0
        self.requests[request.key] = request
        if request.grammar is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.grammar_waiting.append(request)
        else:
            self.waiting.append(request)

    def promote_grammars(self) -> list[Request]:
        """Move requests whose grammar compiled into `waiting`; finish (ABORT, with `error`)
        those whose grammar failed or timed out and return them. Others keep compiling."""
        failed: list[Request] = []
        for req in list(self.grammar_waiting):
            try:
                ready = req.grammar.poll()
            except GrammarError as e:
                req.error = str(e)
                self.finish(req, FinishReason.ABORT)
                failed.append(req)
                continue
            if ready:
                self.grammar_waiting.remove(req)
                req.status = RequestStatus.WAITING
                self.waiting.append(req)
        return failed

    def abort(self, req: Request) -> None:
        if not req.finished:
            self.finish(req, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.grammar_waiting
                    or (self.remote is not None and self.remote.loading))

    @property
    def only_compiling(self) -> bool:
        """Nothing to plan: every unfinished request waits for its grammar."""
        return bool(self.grammar_waiting) and not self.waiting and not self.running

    @property
    def waits_elsewhere(self) -> bool:
        """Nothing planned may still be progress: a grammar compiles with nothing else to run,
        or a KV transfer (a load, or a send holding blocks) is in flight."""
        return self.only_compiling or (self.remote is not None and self.remote.busy)

    @property
    def num_unreleased(self) -> int:
        return len(self.requests)

    # ---- plan ---------------------------------------------------------------------------------
    @property
    def has_releases(self) -> bool:
        """Request indices were released, or KV transfers planned, since the last plan (the
        runner learns of them from the next one)."""
        return bool(self._released) or (self.remote is not None and self.remote.has_planned)

    def releases_only(self) -> SchedulerOutput:
        """A plan without rows that hands the runner the indices released since the last plan."""
        out = SchedulerOutput(StepPlan(released=self._released))
        self._released = []
        self._attach_kv_meta(out)
        return out

    def _attach_kv_meta(self, out: SchedulerOutput) -> None:
        if self.remote is not None and self.remote.has_planned:
            out.plan.kv_connector_metadata = self.remote.build_meta()

    def plan(self) -> SchedulerOutput:
        out = SchedulerOutput(StepPlan(released=self._released))
        self._released = []
        budget = self.config.max_num_batched_tokens
        running = RequestStatus.RUNNING
        k_eff = self._spec_width()
        out.spec_k = k_eff
        out.plan.propose = k_eff > 0
        lookahead = self._lookahead(out)
        finishing = 0  # running requests with every output sampled: they end at its commit
        for req in list(self.running):  # a copy: preemption edits the list
            if budget == 0:
                break
            # Inlined Request.num_planned_outputs / num_known_tokens: this loop runs for every
            # running request every step.
            n_out = len(req.output_token_ids) + req.num_pending
            if req.status is not running or n_out >= req.max_tokens:
                if req.status is running:
                    finishing += 1  # every output already sampled: it plans no more rows
                continue  # preempted this step, or finishing
            known = len(req.prompt_token_ids) + n_out
            # A live speculative request runs a plain row (positions from the host, the plain
            # decode path) when its length is known on the host (no row in flight verifies
            # drafts: each adds exactly one token) and the step verifies none, or it has none to
            # verify (its last sampling row proposed none: this one proposes), or its grammar's
            # gate is closed; else a speculative row. Inlined: it runs for every row and step.
            if req.spec_live and req.spec_k and (
                    req.num_pending_max != req.num_pending
                    or (k_eff and req.spec_drafted and not _gated(req))):
                budget -= self._plan_spec_row(req, budget, out, k_eff)
                continue
            num_new = min(known - req.num_computed_tokens, budget)
            end = req.num_computed_tokens + num_new
            reserve = self._row_reserve(req, end, known, lookahead) if lookahead else end
            if num_new > 0 and self._reserve(req, reserve):
                self._add_row(req, num_new, out)
                budget -= num_new
        self._admit_waiting(budget, out, finishing)
        # A request preempted above with no step in flight released its index at once, and
        # admission may have handed that index to a new request: the runner drops the old
        # occupant first (it applies `released` before `new_requests`).
        out.plan.released.extend(self._released)
        self._released = []
        self._attach_kv_meta(out)
        if out.plan.rows:
            out.plan.step = self.num_steps
            self.num_steps += 1
        return out

    def _spec_width(self) -> int:
        """K_eff, the drafts this step's speculative rows verify: the policy's choice for the
        batch (host data only), or K without a policy. The batch: the running requests and the
        waiting ones it may admit (the step proposes for their first sampling rows), at most
        `max_running`: the rows of the steps the policy times, so its estimates are of the
        batch sizes it is asked about."""
        if not self.spec_k or self.spec_policy is None:
            return self.spec_k
        batch = min(len(self.running) + len(self.waiting), self.max_running)
        return min(self.spec_k, self.spec_policy.choose(batch))

    def _plan_spec_row(self, req: Request, budget: int, out: SchedulerOutput, k: int) -> int:
        """A speculative row verifying `k` drafts for `req` if the budget and the KV cache
        allow; the tokens it uses."""
        if budget < k + 1:
            return 0  # the next step (the engine refuses a budget below K + 1)
        bound = req.num_committed_tokens + req.num_pending_max  # the length on the device, at most
        if not self._reserve(req, self._spec_reserve(req, bound)):
            return 0
        out.plan.rows.append(ScheduledRow(req.req_index, bound - 1, k + 1, True,
                                          req.num_planned_outputs, self.kv.block_table(req.key),
                                          spec=k, speculative=True))
        out.requests.append(req)
        out.plan.num_tokens += k + 1
        req.num_computed_tokens += 1  # the last known token's position; drafts count at commit
        req.num_pending += 1
        req.num_pending_max += k + 1
        req.spec_drafted = out.plan.propose
        req.inflight_refs += 1
        return k + 1

    def _spec_reserve(self, req: Request, bound: int) -> int:
        """KV positions a speculative row may write: up to its K-th draft, within max_model_len
        (the device sends positions past the request's blocks to the null block)."""
        return min(bound + req.spec_k + self.draft_lookahead, self.max_model_len)

    def _lookahead(self, out: SchedulerOutput) -> int:
        """KV positions past a sampling row for the draft model's steps after it: only a step
        that proposes runs them."""
        return self.draft_lookahead if out.plan.propose else 0

    def _row_reserve(self, req: Request, end: int, known: int, lookahead: int) -> int:
        """KV positions a plain row ending at `end` may write: a speculative request's sampling
        row (end == known) also the `lookahead` positions of the draft model's steps after it
        (0 in a step that proposes nothing: it runs none), within max_model_len."""
        if lookahead and req.spec_k and end == known:
            return max(end, min(end + lookahead, self.max_model_len))
        return end

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """KV blocks for the row (`num_tokens` positions in all), preempting lower-priority
        requests if needed. Without a later request to preempt, `req` waits for blocks a victim
        still returns (its in-flight step commits) rather than preempting itself."""
        while not self.kv.allocate(req.key, num_tokens):
            victim = self._pick_victim(req)
            if victim is req and self._blocks_in_transit():
                return False
            self.preempt(victim)
            if victim is req or victim.req_index is not None:
                return False  # blocks come back once the victim's in-flight step commits
        return True

    def _pick_victim(self, req: Request) -> Request:
        """Lowest-priority running request not yet planned this step (the last one after `req`
        in `running`: preempted ones leave the list); `req` itself when there is none."""
        i = self.running.index(req)
        return self.running[-1] if i + 1 < len(self.running) else req

    def _blocks_in_transit(self) -> bool:
        """A preempted request still holds its blocks (a launched or staged step reads them):
        they come back at that step's commit. Preempted requests wait at the queue's head."""
        for r in self.waiting:
            if r.status is not RequestStatus.PREEMPTED:
                return False
            if r.req_index is not None:
                return True
        return False

    def _admit_waiting(self, budget: int, out: SchedulerOutput, finishing: int) -> None:
        """Admit waiting requests in queue order (preempted ones wait at its head) while the
        budget, the batch and the KV cache allow. A request whose adapter finds no slot is
        skipped (SlotGate): it keeps its place, and those behind it that can run go on.

        The batch counts the running requests but the `finishing` ones: every output of those
        is sampled, so they plan no more rows and end when their last step commits; their
        successors start in this step rather than one step later. Their indices and KV blocks
        stay theirs until then (the request table holds two steps' requests)."""
        waiting, skipped = self.waiting, []
        gate = SlotGate(self.lora, self.config.max_num_seqs) if self.lora is not None else None
        while waiting and budget > 0 and len(self.running) - finishing < self.max_running:
            req = waiting[0]
            if req.inflight_refs > 0:
                break  # a preempted request whose last step is still in flight (FCFS: wait)
            if req.lora_request is not None and not gate.admits(req):
                skipped.append(waiting.popleft())  # before its prefix match: skipping is cheap
                continue
            prefix, start = self._admission_prefix(req)
            if start < 0:
                if start == -1:
                    break
                continue  # it waits for its KV cache from a prefill instance
            num_new = min(req.num_known_tokens - start, budget)
            end = self._row_reserve(req, start + num_new, req.num_known_tokens,
                                    self._lookahead(out))
            if not self.kv.allocate(req.key, end, prefix, req.block_extra):
                break
            self.waiting.popleft()
            req.kv_loaded = False
            req.status = RequestStatus.RUNNING
            req.spec_live = False  # a new table entry: its length is not on the device yet
            self._take_index(req, out)
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
                req.num_cached_tokens = prefix.num_tokens
            req.num_computed_tokens = start
            self.running.append(req)
            self._add_row(req, num_new, out)
            budget -= num_new
            if req.lora_request is not None:
                gate.admitted(req)
        waiting.extendleft(reversed(skipped))  # in their places, ahead of those not reached

    def _admission_prefix(self, req: Request) -> tuple[PrefixMatch, int]:
        """The waiting head's prefix-cache hit and first position to compute; -1: no blocks for
        its remote load now (admission stops), -2: it went to WAITING_FOR_REMOTE_KV."""
        if req.kv_loaded:  # its blocks hold the loaded prompt already
            return PrefixMatch(), req.num_computed_tokens
        # Prompt logprobs need the logits of every prompt position: no cached prefix.
        prefix = (self.kv.match_prefix(req.all_token_ids, req.block_extra)
                  if req.prompt_logprobs_done
                  else PrefixMatch())
        if self.remote is not None:
            started = self.remote.start_load(req, prefix)
            if started is not None:
                if started:
                    self.waiting.popleft()
                return prefix, -2 if started else -1
        return prefix, prefix.num_tokens

    def kv_transfers_finished(self, sending: set[int], recving: set[int],
                              error_blocks: set[int]) -> list[Request]:
        """The connector's finished transfers: sends free their blocks, loaded requests rejoin
        the waiting queue's head; failed loads recompute or fail (returned, for the output)."""
        remote = self.remote
        remote.sends_finished(sending, self.requests)
        outcome = remote.loads_finished(recving, error_blocks)
        for req in reversed(outcome.loaded):
            self.waiting.appendleft(req)
        failed = []
        for req in outcome.failed:
            if self.on_kv_failure == "fail":
                self.waiting.appendleft(req)  # so that finish() finds it
                self.fail(req, "kv_transfer_params: the KV cache from the prefill instance "
                               "could not be loaded (failed, timed out or its instance is "
                               "gone) and on_failure is 'fail'")
                failed.append(req)
            else:
                self.waiting.appendleft(req)  # computes its prompt here
        return failed

    def _take_index(self, req: Request, out: SchedulerOutput) -> None:
        """The request enters the runner's table: with everything it knows (a waiting request
        has nothing in flight, so its known tokens are its committed ones)."""
        i = req.req_index = self.free_indices.pop()
        self.by_index[i] = req
        if req.lora_request is not None:
            req.lora_slot, load = self.lora.acquire(req.lora_request)
            if load is not None:
                out.plan.lora_loads.append(load)
        k = req.params.prompt_logprobs
        out.plan.new_requests.append(NewRequest(
            i, req.all_token_ids, req.sampling,
            -1 if k is None or req.prompt_logprobs_done else k, req.spec_k, req.lora_slot))
        out.admitted.append(req)

    def _add_row(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        start = req.num_computed_tokens
        sample = start + num_new == req.num_known_tokens
        out.plan.rows.append(ScheduledRow(req.req_index, start, num_new, sample,
                                          req.num_planned_outputs,
                                          self.kv.block_table(req.key)))
        out.requests.append(req)
        out.plan.num_tokens += num_new
        if num_new != 1 or (out.spec_k and req.spec_k):
            out.decode_step = False
        req.num_computed_tokens += num_new
        req.num_pending += int(sample)
        req.num_pending_max += int(sample)
        req.spec_live = req.spec_live or sample
        if sample and req.spec_k:
            req.spec_drafted = out.plan.propose  # the runner proposes after this row
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
