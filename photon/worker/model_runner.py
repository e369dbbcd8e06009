"""ModelRunner: owns every device tensor, stream and event; implements photon.core.runner.StepRunner.

prepare(plan) -> apply the plan's table changes, build the step's inputs and stage them into the
                 free slot's pinned buffers (host)
launch(prep)  -> enqueue their H2D and the forward (returns a handle)
sample(h)     -> sample on the compute stream (grammar masks from the MaskSource), write tokens
                 into the device token pool, enqueue D2H (speculative rows: verify their drafts
                 and propose the next ones; photon.worker.spec_step): photon.worker.sample_stage
sync(h)       -> the commit's host sync (the blocking loop calls it right after sample)
wait(h)       -> sync, then the sampled tokens as Python values

The device token pool `[rows, max_model_len + 1]` holds every known token of every request in the
table (row = request index). The sampler writes token t there, and forward t+1 reads its decode
inputs from it, so a sampled token never has to reach the host before the next forward is launched.
The runner knows requests only by index (photon.core.step): it never imports the scheduler.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

from photon.attention.backend import AttentionMetadata, ForwardContext, create_backend
from photon.attention.kv_quant import CheckpointKVScales, build_kv_scales, kv_cache_dtype
from photon.config import EngineConfig, check_kv_capacity
from photon.core.inputs import StepInputs, float_arrays, int_arrays
from photon.core.runner import MaskSource
from photon.core.step import (
    CommittedToken,
    PromptScores,
    StepPlan,
    request_table_size,
)
from photon.distributed.dp_experts import DPExperts
from photon.distributed.group import TPGroup
from photon.kv_transfer.base import KVConnectorBase
from photon.kv_transfer.metadata import KVConnectorMetadata
from photon.lora.worker import LoRAWorker, StagedLoad, any_adapter
from photon.model.loader import load_model
from photon.sampling_params import MAX_LOGPROBS
from photon.spec.draft_config import draft_model_config
from photon.structured.backend import bitmask_width
from photon.structured.bitmask import MaskViews, mask_numel
from photon.worker.cuda_graph import GraphModel, staged_rows
from photon.worker.decode_inputs import build_decode_inputs, build_spec_inputs, is_plain_decode
from photon.worker.draft_lag import DraftLag, FillChunk
from photon.worker.draft_runner import DraftRunner, kv_block_bytes
from photon.worker.inputs import HostStep, build_step_inputs, pad_tokens
from photon.worker.kv_sizing import usable_blocks
from photon.worker.piecewise_graphs import MAX_TOKENS as PIECEWISE_MAX_TOKENS
from photon.worker.piecewise_graphs import PiecewiseGraphs
from photon.worker.probe import StepProbe
from photon.worker.request_table import RequestTable
from photon.worker.sample_stage import SampleStage
from photon.worker.sampler import Sampler, token_logprobs
from photon.worker.slots import StepSlot, Streams
from photon.worker.spec_graphs import SpecKey, StepGraphs, uniform_spec_k
from photon.worker.spec_sample_graphs import SpecSampleGraphs
from photon.worker.spec_step import SpecDecoder
from photon.worker.step_results import (
    PreparedStep,
    StepHandle,
    committed_tokens,
    prompt_scores,
    sampled_tokens,
)

# Prompt positions whose logits are computed at once for prompt logprobs: bounds the [N, V]
# float32 logits (and their log-softmax) however long the chunk is.
PROMPT_LOGITS_CHUNK = 256


class ModelRunner:
    def __init__(self, config: EngineConfig, masks: MaskSource | None = None,
                 on_fault: Callable[[int, str], None] | None = None,
                 tp: TPGroup | None = None, dp_experts: DPExperts | None = None) -> None:
        """tp: this rank's tensor-parallel group (None: one rank). Every rank builds a runner over
        its shard of the model and the KV heads; only rank 0 downloads the sampled tokens.
        dp_experts: the MoE experts are partitioned over the data-parallel cores of this group
        (photon.distributed.dp_experts)."""
        self.config = config
        self.tp = tp if tp is not None else TPGroup.single()
        # Ends the request at an index whose inputs could not be staged (see _add_requests);
        # None: raise. Held weakly: the engine owning this runner passes its own method, and a
        # reference cycle would keep both (and the grammar worker) alive after the engine is
        # dropped.
        self._on_fault = None if on_fault is None else weakref.WeakMethod(on_fault)
        self.device = torch.device(config.device)
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        torch.manual_seed(config.model.seed)
        # The draft model's cache (below) keeps its model's dtype: only the target's is FP8.
        self.kv_dtype = kv_cache_dtype(config.cache.cache_dtype, self.dtype)
        ckpt_scales = CheckpointKVScales()
        self.model = load_model(config.model, config.device, self.tp,
                                config.parallel.enable_expert_parallel, ckpt_scales, dp_experts)
        self.backend = create_backend(config.attention_backend, config.device)
        # Before the KV cache is sized: the slot weights take device memory.
        self.lora = self._lora_worker()
        spec = config.speculative_config
        # method draft_model: a second model whose KV blocks share the target's block ids
        self.draft_config = (draft_model_config(config) if spec is not None
                             and spec.method == "draft_model" else None)
        self.num_blocks = self._num_blocks()
        mc = config.model
        shape = (2, self.num_blocks, self.block_size, self.tp.local_kv_heads(mc.num_kv_heads),
                 mc.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                          for _ in range(mc.num_layers)]
        self.kv_scales = build_kv_scales(
            config.cache.cache_dtype, config.cache.calculate_kv_scales, ckpt_scales,
            mc.num_layers, mc.num_kv_heads, shape[3], self._first_kv_head(), self.device)
        max_seqs = config.scheduler.max_num_seqs
        num_rows = request_table_size(max_seqs)
        self.pool_width = mc.max_model_len + 1
        # One row past the request indices: the scratch row that the padding rows of sampling
        # graphs write (photon.worker.spec_sample_graphs); no request ever holds it.
        self.scratch_row = num_rows
        self.token_pool = torch.zeros(num_rows + 1, self.pool_width, dtype=torch.int32,
                                      device=self.device)
        max_blocks = math.ceil(self.pool_width / self.block_size)
        self.table = RequestTable(num_rows, max_blocks)
        self.draft_lag = None if self.draft_config is None else DraftLag(
            num_rows, self.num_blocks, self.block_size, self.pool_width,
            config.scheduler.max_num_batched_tokens, self.table)
        self.streams = Streams(self.device,
                               device_waits=config.structured_outputs.mask_wait == "device")
        tokens = config.scheduler.max_num_batched_tokens
        # Backends cover at most the model's vocabulary: the widest masks a step can have.
        words = bitmask_width(mc.vocab_size)
        self.spec = None if spec is None else SpecDecoder(
            spec, mc.max_model_len, num_rows + 1, self.pool_width, self.block_size, self.device,
            fused=mc.use_triton)
        self.draft = None if self.draft_config is None else DraftRunner(
            self.draft_config, self.num_blocks, self.block_size, num_rows, mc.max_model_len,
            self.backend, self.device)
        # KV positions the scheduler reserves past a row's target writes for the draft's steps
        self.draft_lookahead = 0 if self.draft is None else spec.k

        # Sampling rows: a speculative row samples K + 1.
        sampling_rows = max_seqs * (1 + (spec.k if spec is not None else 0))
        self.slots = [StepSlot(i, self.device, sampling_rows, MAX_LOGPROBS,
                               8 * tokens + 16 * sampling_rows, 8 * sampling_rows,
                               mask_numel(sampling_rows, words)) for i in range(2)]
        self.sampler = Sampler(fused=config.model.use_triton)
        self.sampling = SampleStage(self.sampler, self.spec, self.draft, self.token_pool,
                                    self.streams, masks, MaskViews(words),
                                    self.model.compute_logits, self.tp.is_first)
        self.probe: StepProbe | None = None
        # Disaggregation: the KV connector's worker side (attach_kv_connector); None: none
        self.kv_connector: KVConnectorBase | None = None
        self.graphs: StepGraphs | None = None
        # Graphs capture one rank's kernels only: with tp > 1, or experts over the data-parallel
        # cores (whose every forward agrees on its padded size on the host), steps run eagerly.
        if self.device.type == "cuda" and not config.enforce_eager and self.tp.size == 1 \
                and dp_experts is None:
            fwd = GraphModel(self.model, self.backend, self.kv_caches, self.token_pool, self.draft,
                             None if self.lora is None else self.lora.batch,
                             self.kv_scales)
            self.graphs = StepGraphs.build(fwd, config, max_blocks, self.device)
            self.graphs.capture()
            self.sampling.graphs = self._sample_graphs()
            if self.draft is not None:
                self.draft.capture_graphs(max_seqs, max_blocks, spec.k)
        # Steps no other graph holds replay piecewise graphs.
        self.piecewise: PiecewiseGraphs | None = None
        if self.graphs is not None and PiecewiseGraphs.supports(self.model):
            self.piecewise = PiecewiseGraphs(self.model.model, self.kv_caches, self.backend,
                                             self.kv_scales, min(PIECEWISE_MAX_TOKENS, tokens),
                                             self.device,
                                             None if self.lora is None else self.lora.batch)
            self.piecewise.capture()
            if self.draft is not None:
                self.draft.capture_piecewise(self.piecewise.buckets[-1])
        if self.kv_scales is not None:
            # After the capture: graphs never calibrate, and steps run eagerly until it is done.
            self.kv_scales.start_calibration()

    def _sample_graphs(self) -> SpecSampleGraphs | None:
        """Graphs for the sampling of speculative graphs' steps (photon.worker.spec_sample_graphs)."""
        if self.graphs is None or self.graphs.spec is None or self.spec is None:
            return None
        graphs = SpecSampleGraphs(self.graphs.spec, self.model.compute_logits, self.spec,
                                  self.sampler, self.token_pool, self.scratch_row, self.draft)
        graphs.capture()
        return graphs

    def _lora_worker(self) -> LoRAWorker | None:
        cfg = self.config
        if cfg.lora_config is None:
            return None
        spec = cfg.speculative_config
        # Tokens of a forward, padded graph batches included
        tokens = max(cfg.scheduler.max_num_batched_tokens,
                     cfg.scheduler.max_num_seqs * (1 + (spec.k if spec is not None else 0)))
        return LoRAWorker(cfg.lora_config, self.model, cfg.model.hf_config, tokens, self.device,
                          self.dtype, cfg.model.use_triton)

    # ---- sizing -------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """A block id's bytes on this rank: the target's KV block (this rank's KV heads), plus the
        draft model's (same id)."""
        mc = self.config.model
        size = (kv_block_bytes(mc, self.block_size, self.kv_dtype) // mc.num_kv_heads
                * self.tp.local_kv_heads(mc.num_kv_heads))
        if self.draft_config is not None:
            size += kv_block_bytes(self.draft_config, self.block_size)
        return size

    def _first_kv_head(self) -> int:
        """This rank's first KV head (heads are replicated when fewer than the ranks)."""
        total = self.config.model.num_kv_heads
        return self.tp.rank // max(1, self.tp.size // total) * self.tp.local_kv_heads(total)

    def _num_blocks(self) -> int:
        """Usable blocks + the reserved null block 0. Refuses to start when one max_model_len
        request would not fit (every long request would fail)."""
        usable, remedy = usable_blocks(self.config, self.device,
                                       self.kv_bytes_per_block())
        usable = self.tp.min_int(usable)  # the block ids every rank can hold
        check_kv_capacity(usable, self.block_size, self.config.model.max_model_len, remedy)
        return usable + 1

    # ---- the request table ----------------------------------------------------------------
    def _apply_table_changes(self, plan: StepPlan) -> None:
        for i in plan.released:
            self.table.remove(i)
            if self.draft_lag is not None:
                self.draft_lag.reset(i)
        for new in plan.new_requests:
            if self.draft_lag is not None:
                self.draft_lag.reset(new.req_index)
            try:
                self.table.add(new)
            except Exception as e:  # noqa: BLE001 - one request's values must not stop the engine
                on_fault = self._on_fault() if self._on_fault is not None else None
                if on_fault is None:
                    raise
                # Its row runs this step with inert constants as a zombie whose token is
                # ignored; then the scheduler releases it like any finished request.
                self.table.add_inert(new)
                on_fault(new.req_index, f"internal error: the request's inputs could not be "
                                        f"staged ({type(e).__name__}: {e})")

    # ---- KV transfers ---------------------------------------------------------------------
    def attach_kv_connector(self, connector: KVConnectorBase) -> None:
        connector.register_kv_caches(self.kv_caches)
        self.kv_connector = connector

    def _start_kv_transfers(self, meta: KVConnectorMetadata | None) -> None:
        """The plan's loads (into blocks no step reads until they finished) and saves (of
        blocks whose KV a committed step wrote): issued, never awaited here."""
        c = self.kv_connector
        if meta is None or c is None or meta.empty:
            return
        c.bind_connector_metadata(meta)
        c.start_load_kv()
        for layer in range(len(self.kv_caches)):
            c.save_kv_layer(layer)
        c.wait_for_save()
        c.clear_connector_metadata()

    # ---- prepare / launch ---------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> PreparedStep | None:
        """Host half of a launch: the plan's table changes and KV transfers, the step's inputs,
        staged into its slot's pinned buffers (None for an empty plan). The pipelined loop
        prepares t+2 while the grammar fill of t+1 runs."""
        self._apply_table_changes(plan)
        self._start_kv_transfers(plan.kv_connector_metadata)
        if plan.empty:
            return None
        rows = plan.rows
        plain_decode = is_plain_decode(rows)
        if plain_decode:
            self.table.sync_blocks(rows)
            # the draft's steps after sampling (their KV past seq_len) run only if it proposes
            host = build_decode_inputs(rows, self.table, self.block_size, self.pool_width,
                                       self.draft_lookahead if plan.propose else 0)
        elif (k := uniform_spec_k(rows)) is not None:
            host = build_spec_inputs(rows, self.table, k, self.pool_width, self.block_size)
        else:
            host = build_step_inputs(rows, self.table, self.block_size, self.pool_width)
        idx, valid = host.pool_valid
        self.table.pool_valid[idx] = valid
        fill: list[FillChunk] = []
        if self.draft_lag is not None:
            # a decode step's inputs have one position and pool row per row: the rows' own
            per_row = (host.inputs.pool_rows, host.inputs.positions) if plain_decode else None
            host.skip_draft, fill = self.draft_lag.step(rows, plan.propose, plain_decode, per_row)
        calibrating = self.kv_scales is not None and self.kv_scales.calibrating
        graph_key = None if self.graphs is None or calibrating else self.graphs.plan(rows, host)
        if graph_key is None and self.piecewise is not None and not calibrating:
            host.bucket = self.piecewise.bucket(host.inputs.positions.shape[0]) or 0
            pad_tokens(host, host.bucket)
        slot = self.slots[plan.step % 2]
        ints, floats = slot.stage(int_arrays(host.inputs), float_arrays(host.inputs))
        return PreparedStep(slot, rows, host, StepInputs(*ints, *floats), graph_key, plan.step,
                            plan.propose, self._stage_lora(plan), fill)

    def _stage_lora(self, plan: StepPlan) -> list[StagedLoad]:
        """The plan's adapter loads from the host cache; the requests of a slot whose adapter
        could not be read end (their rows run once as zombies over zero weights)."""
        if self.lora is None or not plan.lora_loads:
            return []
        staged, failed = self.lora.stage(plan.lora_loads)
        on_fault = self._on_fault() if self._on_fault is not None else None
        for new in plan.new_requests:
            error = failed.get(new.lora_slot) if new.lora_slot else None
            if error is not None and on_fault is not None:
                on_fault(new.req_index, error)
        return staged

    @torch.inference_mode()
    def launch(self, prep: PreparedStep) -> StepHandle:
        """Device half: the H2D of the staged inputs and the forward, enqueued."""
        slot, host, dev = prep.slot, prep.host, prep.dev
        if self.lora is not None:  # on the copy stream, ahead of the inputs the forward waits for
            self.lora.load(prep.lora_loads, self.streams.copy)
        slot.upload(self.streams)
        marks = self.probe.new_step() if self.probe is not None else None
        if marks is not None:
            self.probe.mark(marks, "fwd_start")
        if host.inputs.write_idx.size:
            self.token_pool.view(-1)[dev.write_idx] = dev.write_ids.to(torch.int32)
        if prep.draft_fill:
            self.draft.fill(prep.draft_fill, self.token_pool)
        if self.lora is not None:
            self.lora.launch(dev.lora_slots, prep.graph_key is None and not host.bucket
                             and any_adapter(host.inputs.lora_slots))
        if host.widths is not None:
            self.spec.resolve(dev, staged_rows(dev), host.spec_k)
        if prep.graph_key is not None:
            hidden = self.graphs.run(prep.graph_key, dev, len(prep.rows))
        else:
            hidden = self._forward_eager(staged_rows(dev), host, dev)
        logits = deferred = None
        if isinstance(prep.graph_key, SpecKey) and self.sampling.graphs is not None:
            deferred = (prep.graph_key, hidden)  # every token samples: sample() decides how
        elif host.sample_rows:
            sel = hidden if host.decode_only else hidden[dev.logits_indices]
            logits = self.model.compute_logits(sel)
        slot.reserve_prompt(host.inputs.plp_idx.size, max(host.prompt_k, 0))
        if host.prompt_spans:
            self._score_prompt(slot, hidden, dev, host.prompt_k)
        if marks is not None:
            self.probe.mark(marks, "fwd_end")
        return StepHandle(slot, prep.rows, host, dev, logits, prep.step, prep.propose,
                          len(host.sample_rows), host.flags.max_logprobs, marks, deferred)

    def _score_prompt(self, slot: StepSlot, hidden: torch.Tensor, dev: StepInputs[torch.Tensor],
                      k: int) -> None:
        """Prompt logprobs of the step's scored prompt tokens into the slot's outputs (downloaded
        with the sampled tokens): log-softmax in float32, the token's rank, the top k."""
        idx, tokens = dev.plp_idx, dev.plp_tokens
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

    def _forward_eager(self, num_rows: int, host: HostStep, dev: StepInputs[torch.Tensor]
                       ) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=dev.slot_mapping,
            block_tables=dev.block_tables.view(num_rows, -1).to(torch.int32),
            seq_lens=dev.seq_lens.to(torch.int32),
            query_start_loc=dev.query_start_loc.to(torch.int32),
            seq_lens_host=host.seq_lens,
            query_lens_host=host.query_lens,
            decode_only=host.decode_only,
            seq_lens_exact=host.widths is None,
        )
        input_ids = self.token_pool.view(-1)[dev.pool_idx].long()
        if self.draft is not None and not host.skip_draft:
            self.draft.catch_up(input_ids, dev.positions, meta, host.bucket)
        ctx = ForwardContext(meta, self.kv_caches, self.backend, self.kv_scales)
        if host.bucket:
            hidden = self.piecewise.run(host.bucket, input_ids, dev.positions, ctx)
        else:
            hidden = self.model(input_ids, dev.positions, ctx)
        if self.kv_scales is not None:
            self.kv_scales.finish_calibration()
        return hidden[:hidden.shape[0] - host.padding]

    # ---- sample -------------------------------------------------------------------------------
    def sample(self, h: StepHandle) -> None:
        """Sample step t+1 with the state committed at t (photon.worker.sample_stage)."""
        self.sampling.sample(h, self.probe)

    # ---- commit's wait -----------------------------------------------------------------------
    def sync(self, h: StepHandle) -> None:
        """Block the host until step `h`'s tokens are on the host (idempotent)."""
        if self.probe is not None:
            t0 = time.perf_counter()
            h.slot.wait()
            self.probe.wait_s += time.perf_counter() - t0
        else:
            h.slot.wait()

    def wait(self, h: StepHandle) -> list[list[CommittedToken]]:
        """commit's wait: sync, then each row's committed tokens (and logprobs, the step's most
        alternatives) as Python values: one per plain sampling row, 1 to K + 1 per speculative
        row, none for rows that do not sample."""
        self.sync(h)
        return committed_tokens(h, self.spec)

    def sampled_ids(self, h: StepHandle) -> np.ndarray:
        """Every sampling row's token in sampling order, a speculative row's K_eff + 1 (its
        emitted tokens, then negative entries): a view of the slot's host buffer, read it before
        the slot's next step is staged."""
        return sampled_tokens(h)

    def prompt_scores(self, h: StepHandle) -> list[PromptScores]:
        """Step `h`'s prompt logprobs as Python values (after its wait: no further sync)."""
        return prompt_scores(h)
