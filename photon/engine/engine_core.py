"""EngineCore: owns the tokenizer, scheduler, KV manager, model runner and pipeline.

add_request() validates at the edge (clear ValueErrors), step() runs one pipeline iteration and
returns outputs for the requests that changed, abort() finishes a request through the same zombie path as a
stop.

Output modes per request (chosen at add_request):
- cumulative (default, `stream=True`): every output carries all tokens/text so far;
- final-only (`stream=False`, used by `LLM`): reported once, when finished;
- delta (`delta=True`, used by the server): each output carries only what is new since the last
  one (token ids, logprobs, and text from the detokenizer's `get_delta`, which withholds a
  possible stop-string prefix), and a child's `finish_reason` appears exactly once.
"""

from __future__ import annotations

import gc
import itertools
import os
import random
import secrets
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from photon.config import EngineConfig
from photon.core.sampling import derive_key, pack_sampling
from photon.core.step import request_table_size
from photon.distributed.dp_experts import join_dp_experts
from photon.distributed.kv_reports import RankedConnector
from photon.distributed.workers import PlanBroadcast, TPWorkers
from photon.engine.core_outputs import DeltaState, request_output
from photon.engine.detokenizer import IncrementalDetokenizer
from photon.engine.kv_cache import KVCacheManager
from photon.engine.logprobs import TokenTexts
from photon.engine.pipeline import Pipeline
from photon.engine.remote_kv import RemoteKV
from photon.engine.request import Request
from photon.engine.request_checks import RequestChecks
from photon.engine.scheduler import Scheduler
from photon.kv_events.publisher import create_publisher
from photon.kv_transfer.base import KVConnectorRole, create_connector
from photon.kv_transfer.metadata import KVTransferStats
from photon.lora.manager import EngineLoRA, LoRAStats
from photon.lora.request import LoRARequest
from photon.lora.slots import LoRASlotPool
from photon.outputs import RequestOutput
from photon.reasoning import ReasoningParser, get_reasoning_parser
from photon.sampling_params import SamplingParams
from photon.spec import grammar_drafter, sampling_rows
from photon.spec.adaptive import AdaptiveSpec
from photon.spec.guard import RealizedGuard
from photon.spec.stats import SpecDecodingStats
from photon.structured.manager import StructuredOutputManager
from photon.structured.step import GrammarStep
from photon.tokenizer import Tokenizer
from photon.worker.model_runner import ModelRunner


@dataclass
class EngineStats:
    """A snapshot of engine counters (read on the engine's own thread)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # blocks held by live requests / usable blocks
    num_evictable_blocks: int  # free blocks still holding a cached prefix
    prefix_queries: int  # tokens looked up in the prefix cache (cumulative)
    prefix_hits: int  # tokens found (cumulative)
    num_preemptions: int  # cumulative
    spec_decoding: SpecDecodingStats | None = None  # cumulative; None without speculation
    kv_events_dropped: int = 0  # KV event batches dropped: the publisher's queue was full
    kv_transfer: KVTransferStats | None = None  # cumulative; None without a KV connector
    lora: LoRAStats | None = None  # None without --enable-lora


def _freeze_startup_heap() -> None:
    """Move everything alive after startup (weights' wrappers, CUDA graphs, tokenizer tables)
    out of the collector's reach: a full collection would scan it all on the engine thread and
    stall a decode step while the GPU waits (bench structured reports collection time as
    `gc_ms`). What requests create later is still collected."""
    gc.collect()
    gc.freeze()


class EngineCore:
    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        """`detokenize=False`: outputs carry token ids only (no text, no logprob token texts) and
        stop strings are not checked here: the front end of an engine-core process does both."""
        self.config = config
        self.detokenize = detokenize
        self.tokenizer = Tokenizer.from_pretrained(config.model.model)
        self.checks = RequestChecks(config, self.tokenizer)
        # --reasoning-parser: the server splits outputs with it; grammars start after its end
        self.reasoning: ReasoningParser | None = None if config.reasoning_parser is None \
            else get_reasoning_parser(config.reasoning_parser)(self.tokenizer)
        self.structured = StructuredOutputManager(
            config.structured_outputs, self.tokenizer, config.model.vocab_size,
            max_rows=sampling_rows(config), cuda=config.device == "cuda")
        drafter = grammar_drafter(config)  # None: grammar requests do not speculate
        self.grammar = GrammarStep(self.structured,
                                   request_table_size(config.scheduler.max_num_seqs),
                                   drafter.propose if drafter is not None else None)
        # Names this instance's KV transfers (process id first: a peer can tell it is gone).
        self.engine_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        # tp > 1: ranks 1.. run in worker processes; this process is rank 0.
        self.workers = None if config.parallel.tensor_parallel_size == 1 \
            else TPWorkers(config, self.engine_id)
        try:
            # Experts over the data-parallel cores: this core's place in their group (its loop
            # steps in lockstep with the other cores: photon.engine.lockstep).
            self.dp_experts = join_dp_experts(config)
            self.runner = ModelRunner(config, masks=self.grammar, on_fault=self._fail_request,
                                      tp=self.workers.group if self.workers else None,
                                      dp_experts=self.dp_experts)
        except BaseException:
            self.shutdown()
            raise
        events = config.kv_events_config
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching,
                                 enable_kv_cache_events=events is not None and events.publishes)
        spec = config.speculative_config
        self.scheduler = Scheduler(config.scheduler, self.kv,
                                   TokenTexts(self.tokenizer) if detokenize else None,
                                   spec_k=spec.k if spec is not None else 0,
                                   max_model_len=config.model.max_model_len,
                                   draft_lookahead=self.runner.draft_lookahead,
                                   grammar_speculates=drafter is not None)
        if config.lora_config is not None:
            self.scheduler.lora = LoRASlotPool(config.lora_config.max_loras)
        self.lora = EngineLoRA(config.lora_config, self.scheduler, self.runner.lora,
                               config.model.served_model_name)
        for module in config.lora_config.lora_modules if config.lora_config else ():
            self.check_lora(module)  # --lora-modules: a bad adapter stops the start
        if spec is not None and spec.adaptive:  # the adaptive switch: K_eff per step from a cost model
            self.scheduler.spec_policy = AdaptiveSpec(spec.k, self.runner.spec.counters,
                                                      guard=RealizedGuard())
        self._attach_kv_connector()
        ranked = self.runner.kv_connector
        step_runner = self.runner if self.workers is None else PlanBroadcast(
            self.runner, self.workers, ranked if isinstance(ranked, RankedConnector) else None)
        self.pipeline = Pipeline(self.scheduler, step_runner, self.grammar,
                                 config.pipeline_depth)
        self._rng = random.Random(config.model.seed)
        self._ids = itertools.count()
        self.parents: dict[str, list[Request]] = {}  # request id -> its n children
        self._aborted: list[str] = []  # reported by the next step()
        self._final_only: set[str] = set()
        self._delta: dict[str, DeltaState] = {}
        try:  # last: a bad endpoint fails here, with nothing else left to undo but the workers
            self.kv_events = create_publisher(events, config.parallel.data_parallel_rank)
        except BaseException:
            self.shutdown()
            raise
        if self.runner.device.type == "cuda":
            _freeze_startup_heap()

    def _attach_kv_connector(self) -> None:
        """--kv-transfer-config: the connector's worker side in the runner, its scheduler side
        in the scheduler. With tensor parallelism the runner's is rank 0's, which learns what
        the other ranks finished (RankedConnector)."""
        kvt = self.config.kv_transfer_config
        if kvt is None:
            return
        bs, tp = self.config.cache.block_size, self.config.parallel.tensor_parallel_size
        worker = create_connector(kvt, KVConnectorRole.WORKER, self.engine_id, bs, 0, tp)
        if self.workers is not None:
            worker = RankedConnector(worker, self.workers.kv_reports)
        self.runner.attach_kv_connector(worker)
        scheduler = create_connector(kvt, KVConnectorRole.SCHEDULER, self.engine_id, bs, 0, tp)
        handshakes = [worker.get_handshake_metadata()]
        if self.workers is not None:
            handshakes += self.workers.kv_handshakes()
        scheduler.set_xfer_handshake_metadata(
            {rank: m for rank, m in enumerate(handshakes) if m is not None})
        self.scheduler.remote = RemoteKV(scheduler, self.kv)
        self.scheduler.on_kv_failure = kvt.extra.on_failure

    # ---- edge validation (photon.engine.request_checks) --------------------------------------
    def tokenize_prompt(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        return self.checks.tokenize_prompt(prompt)

    def check_fits(self, num_prompt: int, max_tokens: int | None) -> None:
        self.checks.check_fits(num_prompt, max_tokens)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams,
                    request_id: str | None = None, stream: bool = True,
                    delta: bool = False, kv_transfer_params: dict | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a request; with stream=False, step() reports it only once it is finished;
        with delta=True each output carries only what is new (see the module docstring);
        kv_transfer_params: disaggregation (photon.kv_transfer.params); lora_request: the
        LoRA adapter it runs with (None: the base model)."""
        vocab = self.config.model.vocab_size
        kvp = self.checks.kv_transfer_params(kv_transfer_params, params.n)
        self.check_lora(lora_request)
        params.validate_token_ids(vocab)
        if params.structured_outputs is not None and self.workers is not None:
            raise ValueError("structured_outputs: not supported with tensor_parallel_size > 1 yet "
                             "(the ranks would need the grammar masks)")
        text, ids = self.tokenize_prompt(prompt)
        max_tokens = self.checks.max_tokens(len(ids), params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        # Packed for every child before any is queued: a value that does not fit fails the
        # whole request here, and staging it later cannot fail.
        eos = self.tokenizer.eos_token_ids
        packed = [pack_sampling(params, derive_key(seed, i), len(ids), max_tokens, vocab, eos)
                  for i in range(params.n)]
        gate = self._grammar_gate(ids, params)
        children = []
        for i, sampling in enumerate(packed):
            child_id = request_id if params.n == 1 else f"{request_id}-{i}"
            req = Request(child_id, list(ids), params, eos, max_tokens, sampling, prompt=text,
                          parent_id=request_id, index=i)
            req.kv_transfer_params = kvp
            req.lora_request = lora_request
            if self.detokenize and (params.detokenize or params.stop):
                req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params)
            if params.prompt_logprobs is not None and i == 0:  # the children share the prompt
                req.prompt_logprobs = [None]
            if params.structured_outputs is not None:  # compiles once per spec (cached)
                req.grammar = self.structured.request_grammar(params.structured_outputs, gate)
            children.append(req)
            self.scheduler.add(req)
        self.parents[request_id] = children
        if not stream:
            self._final_only.add(request_id)
        if delta:
            self._delta[request_id] = DeltaState([0] * params.n, [False] * params.n)
        return request_id

    def check_lora(self, lora: LoRARequest | None) -> None:
        """A request's adapter, checked (ValueError naming what is wrong; EngineLoRA.check)."""
        self.lora.check(lora)

    def _grammar_gate(self, prompt_ids: list[int], params: SamplingParams) -> int | None:
        """With a reasoning parser, a grammar starts once the reasoning ended (as vLLM): after
        the output's end-of-reasoning token, unless the prompt already ended the reasoning."""
        if params.structured_outputs is None or self.reasoning is None \
                or self.reasoning.is_reasoning_end(prompt_ids):
            return None
        return self.reasoning.end_token_id

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, the KV connector's transfers and the KV events
        publisher (idempotent)."""
        if self.workers is not None:
            self.workers.shutdown()
        runner = getattr(self, "runner", None)
        if runner is not None and runner.kv_connector is not None:
            runner.kv_connector.close()
        publisher = getattr(self, "kv_events", None)  # absent if __init__ failed before it
        if publisher is not None:
            publisher.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache); refused (False) while a
        request holds KV blocks. Publishes AllBlocksCleared at once."""
        done = self.kv.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def _publish_kv_events(self) -> None:
        """Hand this step's KV cache events to the publisher (it only enqueues them)."""
        events = self.kv.take_events()
        if events:
            self.kv_events.publish(events)

    def abort(self, request_id: str) -> None:
        """Abort a request (all its sequences), or one sequence of an n > 1 request by its child
        id (`{request_id}-{index}`); unknown or finished ids are ignored."""
        children = self.parents.get(request_id)
        if children is None:
            parent, _, index = request_id.rpartition("-")
            siblings = self.parents.get(parent, [])
            i = int(index) if index.isdigit() else len(siblings)
            if i >= len(siblings) or siblings[i].request_id != request_id:
                return
            children = [siblings[i]]
        for req in children:
            self.scheduler.abort(req)
        self._aborted.append(children[0].parent_id)

    def _fail_request(self, req_index: int, error: str) -> None:
        """The runner could not stage the request at `req_index`: it ends (ABORT, with
        `error`), reported by this step; the other requests go on."""
        req = self.scheduler.request_at(req_index)
        self.scheduler.fail(req, error)
        self._aborted.append(req.parent_id)

    def has_unfinished(self) -> bool:
        # Releases not yet handed to the runner (an abort while nothing runs): one more step.
        sched = self.scheduler
        return sched.has_unfinished() or not self.pipeline.idle or bool(self._aborted) \
            or sched.has_releases

    def has_pending_transfers(self) -> bool:
        """KV transfers still hold blocks (a prefill's send waits for its decode instance or its
        lease): an engine loop keeps stepping to free them, though no request is unfinished."""
        remote = self.scheduler.remote
        return remote is not None and remote.busy

    def has_work(self) -> bool:
        """What an engine loop steps for: unfinished requests, or transfers to free."""
        return self.has_unfinished() or self.has_pending_transfers()

    def _poll_kv_transfers(self) -> list[Request]:
        """The connector's finished transfers, applied; the requests failed by a load. With
        nothing to run, wait briefly for a transfer instead of spinning."""
        conn, sched = self.runner.kv_connector, self.scheduler
        if conn is None:
            return []
        if self.pipeline.idle and not sched.waiting and not sched.running and conn.has_pending():
            conn.wait_for_progress(0.01)
        if self.pipeline.idle and isinstance(conn, RankedConnector):
            conn.collect_reports()  # no step in flight: the other ranks may be asked now
        sending, recving = conn.get_finished()
        if not (sending or recving):
            return []
        return sched.kv_transfers_finished(sending, recving, conn.get_block_ids_with_load_errors())

    def step(self) -> list[RequestOutput]:
        touched = self._poll_kv_transfers() + self._promote_grammars()
        sched = self.scheduler
        if (sched.has_unfinished() and not sched.only_compiling) or not self.pipeline.idle \
                or sched.has_releases:
            touched += self.pipeline.step()
            self._publish_kv_events()
        self.lora.free_unloaded()  # unloaded adapters whose last request was just released
        parent_ids = dict.fromkeys([*self._aborted, *(r.parent_id for r in touched)])
        self._aborted.clear()
        outputs = []
        for pid in parent_ids:
            children = self.parents.get(pid)
            if children is None:
                continue
            finished = all(r.finished for r in children)
            if finished or pid not in self._final_only:
                outputs.append(self.make_output(pid))
            if finished:
                del self.parents[pid]
                self._final_only.discard(pid)
                self._delta.pop(pid, None)
        return outputs

    def _promote_grammars(self) -> list[Request]:
        """Admit requests whose grammar compiled; return those whose grammar failed. When only
        compiling requests remain, wait briefly for one (there is nothing else to do)."""
        sched = self.scheduler
        if not sched.grammar_waiting:
            return []
        if sched.only_compiling and self.pipeline.idle:
            futures = {r.grammar.future for r in sched.grammar_waiting}
            wait_futures(futures, timeout=0.02, return_when=FIRST_COMPLETED)
        return sched.promote_grammars()

    def make_output(self, parent_id: str) -> RequestOutput:
        return request_output(parent_id, self.parents[parent_id], self._delta.get(parent_id))

    def stats(self) -> EngineStats:
        sched, kv = self.scheduler, self.kv
        return EngineStats(len(sched.running), len(sched.waiting) + len(sched.grammar_waiting),
                           kv.usage,
                           kv.num_cached_free_blocks, kv.prefix_queries, kv.prefix_hits,
                           sched.num_preemptions, self.spec_stats(), self.kv_events.dropped,
                           self.runner.kv_connector.stats() if self.runner.kv_connector else None,
                           self.lora.stats())

    def spec_stats(self) -> SpecDecodingStats | None:
        """Speculative decoding's counters over the committed steps (a snapshot)."""
        spec = self.runner.spec
        return None if spec is None else spec.counters.copy()

    # ---- drain checks -------------------------------------------------------------------------
    def assert_drained(self) -> None:
        """Invariant after a drain: no request alive, every KV block unreferenced, no request
        index held (by the scheduler or, once told, the runner), no open grammar matcher."""
        sched = self.scheduler
        assert not sched.has_unfinished(), "requests still running or waiting"
        assert self.pipeline.idle, "a step is still in flight"
        assert sched.num_unreleased == 0, "finished requests not yet released"
        assert not self.has_pending_transfers(), "KV transfers still hold blocks"
        assert self.kv.num_used_blocks == 0, f"{self.kv.num_used_blocks} KV blocks still held"
        assert len(sched.free_indices) == len(sched.by_index), "request indices leaked"
        live = self.runner.table.num_live
        assert live == 0, f"{live} rows of the runner's table still held"
        if self.workers is not None:
            live, transfers = self.workers.audit()
            assert live == 0, f"{live} rows of a tensor-parallel worker's table still held"
            assert transfers == 0, "a tensor-parallel worker's KV transfers still pending"
        lora = sched.lora
        if lora is not None:
            assert lora.num_used == 0, f"{lora.num_used} LoRA slots still referenced"
            assert not self.lora.freeing, "unloaded LoRA adapters not yet freed"
            lora.check_invariants()
        if self.structured is not None and self.structured.started:
            assert self.structured.executor.open_matchers == 0, "grammar matchers leaked"
        self.kv.check_invariants()
