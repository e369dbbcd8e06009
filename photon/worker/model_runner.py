"""ModelRunner: owns every device tensor, stream and event.

prepare(plan) -> build the step's inputs and stage them into the free slot's pinned buffers (host)
launch(prep)  -> enqueue their H2D and the forward (returns a handle)
finalize(h)   -> sample on the compute stream, write tokens into the device token pool, enqueue D2H
sync(h)       -> the commit's host sync (the blocking loop calls it right after finalize)
wait(h)       -> sync, then the sampled tokens as Python values
begin_grammar_step / end_grammar_step -> submit and collect a step's grammar job (accepts, masks)

The device token pool `[rows, max_model_len + 1]` holds every known token of every live request.
The sampler writes token t there, and forward t+1 reads its decode inputs from it, so a sampled token
never has to reach the host before the next forward is launched.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from photon.attention.backend import AttentionMetadata, ForwardContext, create_backend
from photon.config import EngineConfig, check_kv_capacity, flag
from photon.engine.request import Request
from photon.engine.scheduler import CommittedToken, PromptScores, ScheduledRow, SchedulerOutput
from photon.model.loader import load_model
from photon.sampling_params import MAX_LOGPROBS
from photon.structured.backend import bitmask_width
from photon.structured.bitmask import TokenMask, mask_numel
from photon.structured.executor import StepJob
from photon.structured.manager import RequestGrammar, StructuredOutputManager
from photon.structured.rows import GrammarRows, StepFills
from photon.worker.cuda_graph import DecodeGraphs, pad_decode_arrays
from photon.worker.decode_inputs import build_decode_arrays, is_plain_decode
from photon.worker.inputs import StepArrays, build_step_arrays
from photon.worker.probe import StepMarks, StepProbe
from photon.worker.sampler import Sampler, SamplingBatch, token_logprobs
from photon.worker.sampling_rows import RowState
from photon.worker.slots import StepSlot, Streams

_INT_FIELDS = ("positions", "pool_idx", "slot_mapping", "write_idx", "write_ids", "seq_lens",
               "query_start_loc", "block_tables", "logits_indices", "top_k", "keys", "counters",
               "pool_rows", "prompt_lens", "s_seq_lens", "sample_pool_idx", "ban_rows",
               "ban_tokens", "bias_rows", "bias_tokens", "plp_idx", "plp_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition",
                 "bias_values")
CPU_DEFAULT_KV_BYTES = 256 << 20
_NONE = np.zeros(0, dtype=np.int64)
# Prompt positions whose logits are computed at once for prompt logprobs: bounds the [N, V]
# float32 logits (and their log-softmax) however long the chunk is.
PROMPT_LOGITS_CHUNK = 256


@dataclass
class PreparedStep:
    slot: StepSlot
    rows: list[ScheduledRow]
    arrays: StepArrays
    dev: dict[str, torch.Tensor]  # device views of the staged inputs (valid after the upload)
    graph_key: tuple[int, int] | None


@dataclass
class StepHandle:
    slot: StepSlot
    rows: list[ScheduledRow]
    arrays: StepArrays
    dev: dict[str, torch.Tensor]
    logits: torch.Tensor | None
    num_sampled: int = 0
    max_logprobs: int = -1
    marks: StepMarks | None = None  # set only while a StepProbe is attached (benchmarks)
    masks: TokenMask | None = None  # host views of its grammar masks, once their job was submitted
    fills: StepFills | None = None  # its grammar rows (they accept its tokens at its commit)

    @property
    def sampling_rows(self) -> list[ScheduledRow]:
        """The rows that sample, in sampling order (all of a decode step's)."""
        if len(self.arrays.sample_rows) == len(self.rows):
            return self.rows
        return [self.rows[i] for i in self.arrays.sample_rows]


class ModelRunner:
    def __init__(self, config: EngineConfig,
                 structured: StructuredOutputManager | None = None,
                 on_fault: Callable[[Request, str], None] | None = None) -> None:
        self.config = config
        self.structured = structured  # its executor fills grammar masks (steps with a grammar)
        # Ends a request whose inputs could not be staged (see _assign_row); None: raise. Held
        # weakly: the engine owning this runner passes its own method, and a reference cycle
        # would keep both (and the grammar worker) alive after the engine is dropped.
        self._on_fault = None if on_fault is None else weakref.WeakMethod(on_fault)
        self.device = torch.device(config.device)
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        torch.manual_seed(config.model.seed)
        self.model = load_model(config.model, config.device)
        self.backend = create_backend(config.attention_backend, config.device)
        self.num_blocks = self._num_blocks()
        mc = config.model
        shape = (2, self.num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(mc.num_layers)]
        max_seqs = config.scheduler.max_num_seqs
        # Finalized (zombie) and preempted requests keep their row for at most one more step.
        num_pool_rows = 2 * max_seqs + 1
        self.pool_width = config.model.max_model_len + 1
        self.token_pool = torch.zeros(num_pool_rows, self.pool_width, dtype=torch.int32,
                                      device=self.device)
        self.num_pool_rows = num_pool_rows
        self.row_state = RowState(num_pool_rows, math.ceil(self.pool_width / self.block_size))
        self.free_pool_rows = list(range(num_pool_rows - 1, -1, -1))
        self.streams = Streams(self.device,
                               device_waits=config.structured_outputs.mask_wait == "device")
        tokens = config.scheduler.max_num_batched_tokens
        # Backends cover at most the model's vocabulary: the widest masks a step can have.
        mask_size = mask_numel(max_seqs, bitmask_width(mc.vocab_size))
        self.slots = [StepSlot(i, self.device, max_seqs, MAX_LOGPROBS, 8 * tokens + 16 * max_seqs,
                               8 * max_seqs, mask_size) for i in range(2)]
        self.sampler = Sampler()
        self.step_count = 0
        self.grammar_wait_s = 0.0  # engine-thread time waiting for grammar jobs (bench structured)
        self._grammar_rejected: list[RequestGrammar] = []  # collected, not yet handed on
        self._grammar_lost: str | None = None  # why the executor failed, not yet handed on
        self._grammar_rows: GrammarRows | None = None  # with the first grammar request
        self.probe: StepProbe | None = None
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.backend, self.kv_caches, self.token_pool,
                                       max_seqs, math.ceil(self.pool_width / self.block_size),
                                       self.device)
            self.graphs.capture()

    # ---- sizing -------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        mc = self.config.model
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * elem

    def _num_blocks(self) -> int:
        """Usable blocks + the reserved null block 0. Refuses to start when one max_model_len
        request would not fit (every long request would fail)."""
        usable, remedy = self._usable_blocks()
        check_kv_capacity(usable, self.block_size, self.config.model.max_model_len, remedy)
        return usable + 1

    def _usable_blocks(self) -> tuple[int, str]:
        """The KV blocks requests can use, and what raises their number."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override, f"raise {flag('num_gpu_blocks_override')}"
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
            remedy = f"raise {flag('kv_cache_memory_bytes')}"
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
            remedy = f"raise {flag('gpu_memory_utilization')} (or free GPU memory)"
        else:
            budget = CPU_DEFAULT_KV_BYTES
            remedy = (f"set {flag('kv_cache_memory_bytes')} above the CPU default of "
                      f"{CPU_DEFAULT_KV_BYTES >> 20} MiB")
        sched = self.config.scheduler
        useful = sched.max_num_seqs * math.ceil(self.config.model.max_model_len / self.block_size)
        return max(0, min(budget // self.kv_bytes_per_block() - 1, useful)), remedy

    def _cuda_kv_budget(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_allocated(self.device)
        # Activation headroom: logits of a full batch (fp32, a few copies in the sampler) plus the
        # hidden states of a full token budget, with margin.
        sched, mc = self.config.scheduler, self.config.model
        act = 6 * sched.max_num_seqs * mc.vocab_size * 4
        act += 24 * sched.max_num_batched_tokens * int(mc.hf_config["hidden_size"]) * 4
        budget = int(total * self.config.cache.gpu_memory_utilization) - used_by_others
        budget -= torch.cuda.memory_allocated(self.device) + act + (1 << 30)
        return max(budget, 0)

    # ---- token pool rows (released through the scheduler's release path) ----------------------
    def _assign_pool_rows(self, rows: list[ScheduledRow]) -> None:
        for row in rows:
            req = row.request
            if req.pool_row is None:
                req.pool_row = self.free_pool_rows.pop()
                self._assign_row(req)

    def _assign_row(self, req: Request) -> None:
        """Stage the request's constants into its new pool row. A fault here ends that request
        (`on_fault`: ABORT, with the error), not the engine: its row runs this step with inert
        constants as a zombie whose token is ignored, then its blocks and pool row are freed."""
        try:
            self.row_state.assign(req.pool_row, req)
            if req.grammar is not None or self._grammar_rows is not None:
                self.grammar_rows.assign(req.pool_row, req)
        except Exception as e:  # noqa: BLE001 - one request's values must not stop the engine
            on_fault = self._on_fault() if self._on_fault is not None else None
            if on_fault is None:
                raise
            self.row_state.assign_inert(req.pool_row, req.num_prompt_tokens)
            on_fault(req, f"internal error: the request's inputs could not be staged "
                          f"({type(e).__name__}: {e})")

    @property
    def grammar_rows(self) -> GrammarRows:
        if self._grammar_rows is None:
            assert self.structured is not None, "a grammar request reached a runner without grammars"
            backend = self.structured.backend
            self._grammar_rows = GrammarRows(self.num_pool_rows, backend.stop_token_ids,
                                             backend.mask_words)
        return self._grammar_rows

    def release(self, req: Request) -> None:
        if req.pool_row is not None:
            self.free_pool_rows.append(req.pool_row)
            req.pool_row = None

    # ---- prepare / launch ---------------------------------------------------------------------
    def prepare(self, plan: SchedulerOutput) -> PreparedStep:
        """Host half of a launch: pool rows, the step's input arrays, staged into the free slot's
        pinned buffers. The pipelined loop prepares t+2 while the grammar fill of t+1 runs."""
        slot = self.slots[self.step_count % 2]
        self.step_count += 1
        self._assign_pool_rows(plan.rows)
        if is_plain_decode(plan.rows):
            arrays = build_decode_arrays(plan.rows, self.row_state, self.block_size,
                                         self.pool_width)
        else:
            arrays = build_step_arrays(plan.rows, self.block_size, self.pool_width,
                                       self.row_state.pool_valid, self.row_state)
        graph_key = None
        if self.graphs is not None and arrays.decode_only:
            graph_key = self.graphs.bucket(len(plan.rows), arrays.ints["block_tables"].shape[1])
            if graph_key is not None:
                pad_decode_arrays(arrays.ints, len(plan.rows), *graph_key)
        ints, floats = slot.stage([arrays.ints[k] for k in _INT_FIELDS],
                                  [arrays.floats[k] for k in _FLOAT_FIELDS])
        dev = dict(zip(_INT_FIELDS, ints)) | dict(zip(_FLOAT_FIELDS, floats))
        return PreparedStep(slot, plan.rows, arrays, dev, graph_key)

    @torch.inference_mode()
    def launch(self, prep: PreparedStep) -> StepHandle:
        """Device half: the H2D of the staged inputs and the forward, enqueued."""
        slot, arrays, dev = prep.slot, prep.arrays, prep.dev
        slot.upload(self.streams)
        marks = self.probe.new_step() if self.probe is not None else None
        if marks is not None:
            self.probe.mark(marks, "fwd_start")
        if arrays.ints["write_idx"].size:
            self.token_pool.view(-1)[dev["write_idx"]] = dev["write_ids"].to(torch.int32)
        if prep.graph_key is not None:
            hidden = self.graphs.run(prep.graph_key, dev, len(prep.rows))
        else:
            hidden = self._forward_eager(prep.rows, arrays, dev)
        logits = None
        if arrays.sample_rows:
            sel = hidden if arrays.decode_only else hidden[dev["logits_indices"]]
            logits = self.model.compute_logits(sel)
        slot.reserve_prompt(arrays.ints["plp_idx"].size, max(arrays.prompt_k, 0))
        if arrays.prompt_spans:
            self._score_prompt(slot, hidden, dev, arrays.prompt_k)
        if marks is not None:
            self.probe.mark(marks, "fwd_end")
        return StepHandle(slot, prep.rows, arrays, dev, logits, len(arrays.sample_rows),
                          int(arrays.flags["max_logprobs"]), marks)

    def _score_prompt(self, slot: StepSlot, hidden: torch.Tensor, dev: dict[str, torch.Tensor],
                      k: int) -> None:
        """Prompt logprobs of the step's scored prompt tokens into the slot's outputs (downloaded
        with the sampled tokens): log-softmax in float32, the token's rank, the top k."""
        idx, tokens = dev["plp_idx"], dev["plp_tokens"]
        n = idx.shape[0]
        out = slot.prompt_views(n, k)
        for a in range(0, n, PROMPT_LOGITS_CHUNK):
            b = min(n, a + PROMPT_LOGITS_CHUNK)
            logits = self.model.compute_logits(hidden[idx[a:b]]).float()
            lp, rank, top_ids, top_lp = token_logprobs(torch.log_softmax(logits, dim=-1),
                                                       tokens[a:b], k)
            out.logprob[a:b].copy_(lp)
            out.ranks[a:b].copy_(rank)
            out.topk_ids[a:b].copy_(top_ids)
            out.topk_lp[a:b].copy_(top_lp)

    def _forward_eager(self, rows: list[ScheduledRow], arrays: StepArrays,
                       dev: dict[str, torch.Tensor]) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"],
            block_tables=dev["block_tables"].view(len(rows), -1).to(torch.int32),
            seq_lens=dev["seq_lens"].to(torch.int32),
            query_start_loc=dev["query_start_loc"].to(torch.int32),
            seq_lens_host=arrays.seq_lens_host,
            query_lens_host=arrays.query_lens_host,
            decode_only=arrays.decode_only,
        )
        input_ids = self.token_pool.view(-1)[dev["pool_idx"]].long()
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        return self.model(input_ids, dev["positions"], ctx)

    # ---- finalize -----------------------------------------------------------------------------
    def begin_grammar_step(self, committed: StepHandle | None, h: StepHandle | None) -> None:
        """Submit one grammar job: the matchers accept the tokens of `committed` (step t, its
        wait done), then fill the masks of `h`'s grammar rows (step t+1). The pipelined loop calls
        it right after commit(t)'s wait; the job runs (in the grammar worker) while the engine
        thread appends and plans. Steps without grammar rows return at once."""
        accepting = committed is not None and committed.fills is not None
        if not accepting and (h is None or not h.arrays.flags["any_grammar"]):
            return
        assert not self._grammar_pending, "a grammar job was submitted before the last one ended"
        job = StepJob(_NONE, _NONE, _NONE, _NONE)
        if accepting:
            tokens = committed.slot.out_i_host[:committed.num_sampled].numpy()
            job.acc_handles, job.acc_tokens = self.grammar_rows.accept(
                committed.fills, committed.sampling_rows, tokens)
        mask = None
        if h is not None and h.arrays.flags["any_grammar"]:
            n, table = h.num_sampled, self.grammar_rows
            host = self.structured.executor.mask_buffer(h.slot.index,
                                                        mask_numel(n, table.views.words))
            mask = h.masks = table.views(host, n)
            ints = h.arrays.ints
            h.fills = table.fill(h.sampling_rows, ints["pool_rows"][:n], ints["counters"][:n],
                                 mask)
            job.fill_rows, job.fill_handles = h.fills.rows, h.fills.handles
        if not job.empty and self._grammar_lost is None:
            try:
                self.structured.submit(job, mask, h.slot.index if h is not None else 0)
            except RuntimeError as e:  # finalize makes the masks allow-all (see _grammar_bitmask)
                self._grammar_lost = str(e)

    @property
    def _grammar_pending(self) -> bool:
        """A job was submitted and its result not collected yet (the manager's state)."""
        return self.structured is not None and self.structured.in_flight

    def end_grammar_step(self) -> tuple[list[RequestGrammar], str | None]:
        """Wait for the submitted grammar job if finalize did not; the grammars that rejected
        their token in the jobs collected since the last call, and why the grammar executor
        failed if it did (then every grammar request must end: `Scheduler.fail_grammars`)."""
        self._collect_grammar_job()
        rejected, self._grammar_rejected = self._grammar_rejected, []
        lost, self._grammar_lost = self._grammar_lost, None
        return rejected, lost

    def _collect_grammar_job(self) -> None:
        if not self._grammar_pending:
            return
        start = time.perf_counter()
        try:
            self._grammar_rejected += self.structured.wait()
        except RuntimeError as e:  # the worker died or the job failed: the engine goes on
            self._grammar_lost = str(e)
        self.grammar_wait_s += time.perf_counter() - start

    def _grammar_bitmask(self, h: StepHandle) -> TokenMask | None:
        """The step's masks on the device (their fill fenced: on CUDA with the grammar worker, the
        GPU waits for it, not the engine thread), H2D enqueued. None for steps without
        a grammar row (a host flag): plain steps pay nothing."""
        if not h.arrays.flags["any_grammar"]:
            return None
        if h.masks is None:  # blocking loop, or the first step: fill now
            self.begin_grammar_step(None, h)
        fence = None
        if self._grammar_pending and self.streams.word_wait is not None:
            fence = self.structured.executor.device_fence(h.slot.index)
        if fence is None:
            self._collect_grammar_job()
        if self._grammar_lost is not None:  # no matcher filled them, or only part: unconstrained
            h.masks.flat.fill_(-1)  # (every grammar request fails at the next commit)
        return self.grammar_rows.views(h.slot.upload_mask(self.streams, h.masks, fence),
                                       h.num_sampled)

    def _sampling_batch(self, h: StepHandle) -> SamplingBatch:
        d, f = h.dev, h.arrays.flags
        return SamplingBatch(
            temperature=d["temperature"], top_k=d["top_k"].to(torch.int32), top_p=d["top_p"],
            min_p=d["min_p"], keys=d["keys"], counters=d["counters"],
            presence_penalty=d["presence"], frequency_penalty=d["frequency"],
            repetition_penalty=d["repetition"], ban_rows=d["ban_rows"], ban_tokens=d["ban_tokens"],
            bias_rows=d["bias_rows"], bias_tokens=d["bias_tokens"], bias_values=d["bias_values"],
            token_pool=self.token_pool if f["any_penalties"] else None,
            pool_rows=d["pool_rows"], prompt_lens=d["prompt_lens"], seq_lens=d["s_seq_lens"],
            all_greedy=bool(f["all_greedy"]), any_top_k=bool(f["any_top_k"]),
            any_top_p=bool(f["any_top_p"]), any_min_p=bool(f["any_min_p"]),
            any_penalties=bool(f["any_penalties"]), any_logit_bias=bool(f["any_logit_bias"]),
            max_logprobs=int(f["max_logprobs"]),
            token_bitmask=self._grammar_bitmask(h),
        )

    @torch.inference_mode()
    def finalize(self, h: StepHandle) -> None:
        """Sample step t+1 with the state committed at t; write tokens where forward t+2 reads."""
        if h.logits is None:
            # Nothing to sample, but the fence must still be recorded: commit(t) waiting on it is
            # what makes the slot's staging buffers reusable at t+2.
            h.slot.download(self.streams, 0, -1)
            return
        if h.marks is not None:
            self.probe.mark(h.marks, "smp_start")
        out = self.sampler(h.logits, self._sampling_batch(h), overwrite=True)
        k = h.max_logprobs
        views = h.slot.output_views(h.num_sampled, max(k, 0))
        views.tokens.copy_(out.token_ids)
        if k >= 0:
            views.logprob.copy_(out.logprobs)
            views.ranks.copy_(out.ranks)
            if k > 0:
                views.topk_ids.copy_(out.topk_ids)
                views.topk_lp.copy_(out.topk_logprobs)
        self.token_pool.view(-1)[h.dev["sample_pool_idx"]] = out.token_ids.to(torch.int32)
        if h.marks is not None:
            self.probe.mark(h.marks, "smp_end")
        h.slot.download(self.streams, h.num_sampled, k)

    # ---- commit's wait -----------------------------------------------------------------------
    def sync(self, h: StepHandle) -> None:
        """Block the host until step `h`'s tokens are on the host (idempotent)."""
        if self.probe is not None:
            t0 = time.perf_counter()
            h.slot.wait()
            self.probe.wait_s += time.perf_counter() - t0
        else:
            h.slot.wait()

    def wait(self, h: StepHandle) -> list[CommittedToken | None]:
        """commit's wait: sync, then step `h`'s tokens (and logprobs) as Python values."""
        result: list[CommittedToken | None] = [None] * len(h.rows)
        self.sync(h)
        n, k = h.num_sampled, h.max_logprobs
        if n == 0:
            return result
        host = h.slot.output_views(n, max(k, 0), host=True)
        tokens = host.tokens.tolist()
        lps, ranks = (host.logprob.tolist(), host.ranks.tolist()) if k >= 0 else (None, None)
        top_ids, top_lps = host.topk_ids.tolist(), host.topk_lp.tolist()
        for j, i in enumerate(h.arrays.sample_rows):
            tok = CommittedToken(tokens[j])
            want = h.rows[i].request.params.logprobs
            if lps is not None and want is not None:
                tok.logprob, tok.rank = lps[j], ranks[j]
                tok.top_ids, tok.top_logprobs = top_ids[j][:want], top_lps[j][:want]
            result[i] = tok
        return result

    def prompt_scores(self, h: StepHandle) -> list[PromptScores]:
        """Step `h`'s prompt logprobs as Python values (after its wait: no further sync)."""
        spans = h.arrays.prompt_spans
        if not spans:
            return []
        total = sum(s.count for s in spans)
        host = h.slot.prompt_views(total, max(h.arrays.prompt_k, 0), host=True)
        lps, ranks = host.logprob.tolist(), host.ranks.tolist()
        top_ids, top_lps = host.topk_ids.tolist(), host.topk_lp.tolist()
        scores, at = [], 0
        for s in spans:
            end = at + s.count
            scores.append(PromptScores(
                h.rows[s.row].request, s.first, lps[at:end], ranks[at:end],
                [ids[:s.k] for ids in top_ids[at:end]], [v[:s.k] for v in top_lps[at:end]]))
            at = end
        return scores
