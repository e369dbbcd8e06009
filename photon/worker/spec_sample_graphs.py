"""CUDA graphs for the sampling of speculative decode steps.

A speculative decode step replays its forward as one graph (photon.worker.spec_graphs), then
samples eagerly: the LM head, the scores, the drafts' gather, the verification, the device
lengths and, with ngram, the next proposals; about ten launches whose host cost exceeds the GPU
time they stand for at small batch. For each speculative graph of at most `MAX_ROWS` rows a
sampling graph captures those launches too, reading the forward graph's output. Its inputs are
the step's request indices and its sampling rows' token-pool entries and lengths (resolved at
launch), copied into static buffers; it writes the tokens into a static output that the runner
copies into the step's slot.

A step samples through it when it replayed a speculative graph, every row is greedy with
nothing else to apply (no top-k / top-p / min-p, penalties, logit bias, min-tokens bans,
logprobs or grammar masks), and it proposes (if at all) for every row: ngram's proposal, or
the draft model's K decode steps (over the forward graph's block tables, the steps the draft
graphs capture for eager sampling), are part of the graph. Any other step samples eagerly: the
same ops on the same values, so the same tokens.

The padding rows of a graph's batch (a step of 5 rows replays the graph of 8) sample too: they
stand for the scratch row, a request index past the scheduler's (the runner's token pool and
device lengths have one more row), whose pool entries and device length they read and write.
Their inputs are constants: positions 0..K of the scratch row, so its device length stays at
most K + 2 and its drafts in its pool row; their tokens are not copied out. Capture runs every
row on the scratch row, so capturing touches no request's state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from photon.core.inputs import SamplingFlags, StepInputs
from photon.worker.cuda_graph import Captured
from photon.worker.draft_runner import DraftDecode, DraftRunner
from photon.worker.inputs import HostStep
from photon.worker.sampler import Sampler, SamplingBatch, step_batch
from photon.worker.spec_graphs import SpecGraphs, SpecKey
from photon.worker.spec_step import SpecDecoder

MAX_ROWS = 32  # the largest batch with a sampling graph (its logits stay in the graph's pool)


@dataclass(frozen=True)
class SampleKey:
    spec: SpecKey  # the forward graph whose output the sampling reads
    propose: bool  # the graph also proposes the next drafts


def plain_greedy(flags: SamplingFlags, host: HostStep) -> bool:
    """Every sampling row greedy, with nothing but the draw to apply."""
    return (flags.all_greedy and flags.max_logprobs < 0
            and not (flags.any_top_k or flags.any_top_p or flags.any_min_p
                     or flags.any_penalties or flags.any_logit_bias)
            and host.inputs.ban_rows.size == 0)


class SpecSampleGraphs:
    def __init__(self, forward: SpecGraphs, compute_logits: Callable[[Tensor], Tensor],
                 spec: SpecDecoder, sampler: Sampler, token_pool: Tensor, scratch_row: int,
                 draft: DraftRunner | None = None) -> None:
        self.forward = forward
        self.compute_logits = compute_logits
        self.spec = spec
        self.sampler = sampler
        self.pool = token_pool
        self.scratch_row = scratch_row
        self.draft = draft
        # ngram proposes inside the graph; draft_model too, its K steps over the forward
        # graph's block tables (each row's request's, padding rows' the null block's)
        self.propose_in_graph = spec.proposer.capturable or draft is not None
        self.keys = [SampleKey(key, self.propose_in_graph) for key in forward.keys()
                     if key.batch <= MAX_ROWS]
        tokens = max((k.spec.num_tokens for k in self.keys), default=1)
        rows = max((k.spec.batch for k in self.keys), default=1)
        i64 = dict(dtype=torch.int64, device=token_pool.device)
        self.reqs = torch.full((rows,), scratch_row, **i64)
        self.sample_pool_idx = torch.zeros(tokens, **i64)
        self.sample_seq_lens = torch.ones(tokens, **i64)
        self.out = torch.zeros(tokens, **i64)
        # The padding rows' constants by K_eff: (pool entries, sequence lengths) of every token
        self.padding = {k: self._padding(k, tokens, token_pool.shape[1])
                        for k in {key.spec.k for key in self.keys}}
        self.graphs: dict[SampleKey, Captured] = {}
        # Each graph's constant inputs, built outside its capture: the graph reads their
        # addresses at every replay, so they live as long as it does (photon.worker.cuda_graph).
        self.constants: dict[SampleKey, tuple[StepInputs[Tensor], SamplingBatch]] = {}
        self.replays = 0

    def _padding(self, k: int, tokens: int, pool_width: int) -> tuple[Tensor, Tensor]:
        """Every row at positions 0..k of the scratch row: the entries 1..k + 1 of its pool row
        (where a row's sampled tokens go), lengths 1..k + 1."""
        j = torch.arange(tokens, dtype=torch.int64, device=self.pool.device) % (k + 1)
        return self.scratch_row * pool_width + 1 + j, 1 + j

    def key(self, graph_key: object, host: HostStep, num_rows: int, propose: bool,
            num_proposing: int) -> SampleKey | None:
        """The sampling graph of a step (None: it samples eagerly); the caller checked that it
        has no grammar mask."""
        if not isinstance(graph_key, SpecKey) or not host.only_spec \
                or not plain_greedy(host.flags, host):
            return None
        if propose and num_proposing != num_rows:
            return None
        key = SampleKey(graph_key, propose and self.propose_in_graph)
        return key if key in self.graphs else None

    def _sample(self, key: SampleKey, consts: StepInputs[Tensor], batch: SamplingBatch
                ) -> Tensor:
        spec, k, n = self.spec, key.spec.k, key.spec.num_tokens
        reqs = consts.spec_reqs
        dev = replace(consts, pool_rows=reqs[:, None].expand(-1, k + 1).reshape(-1))
        logits = self.compute_logits(self.forward.graphs[key.spec].out[:n])
        tokens, _ = spec.sample(self.sampler, logits, batch, dev, self.pool, k, only_spec=True)
        spec.advance(tokens, dev, self.pool, k, only_spec=True)
        if key.propose:
            if self.draft is not None:
                tables = self.forward.block_tables(key.spec)
                spec.proposer.bind(DraftDecode(self.draft, tables, key.spec.batch))
            spec.propose(dev.propose_reqs, self.pool)
        self.out[:n].copy_(tokens)
        return self.out[:n]

    def _inputs(self, b: int, k: int) -> StepInputs[Tensor]:
        """The step inputs the sampling reads: static buffers (at capture: every row the
        scratch row's padding), the rest empty or constant (`pool_rows` is derived from the
        request indices inside the graph)."""
        n, dev = b * (k + 1), self.pool.device
        pool_idx, seq_lens = self.padding[k]
        self.sample_pool_idx[:n].copy_(pool_idx[:n])
        self.sample_seq_lens[:n].copy_(seq_lens[:n])
        reqs = self.reqs[:b]
        rows = torch.arange(b, dtype=torch.int64, device=dev)
        i64 = torch.zeros(n, dtype=torch.int64, device=dev)
        f32 = torch.zeros(n, dtype=torch.float32, device=dev)
        none = i64[:0]
        return StepInputs(
            positions=none, pool_idx=none, slot_mapping=none, write_idx=none, write_ids=none,
            seq_lens=none, query_start_loc=none, block_tables=none, logits_indices=none,
            top_k=i64, keys=i64, counters=i64, pool_rows=none, prompt_lens=i64,
            sample_seq_lens=self.sample_seq_lens[:n], sample_pool_idx=self.sample_pool_idx[:n],
            ban_rows=none, ban_tokens=none, ban_until=none, bias_rows=none, bias_tokens=none,
            plp_idx=none, plp_tokens=none, spec_rows=rows, spec_reqs=reqs,
            spec_vrows=rows * (k + 1), propose_reqs=reqs, lora_slots=none, temperature=f32,
            top_p=f32 + 1.0, min_p=f32, presence_penalty=f32, frequency_penalty=f32,
            repetition_penalty=f32 + 1.0, bias_values=f32[:0])

    @torch.inference_mode()
    def capture(self, pool: tuple | None = None) -> tuple | None:
        torch.cuda.synchronize()
        for key in sorted(self.keys, key=lambda key: -key.spec.num_tokens):
            consts = self._inputs(key.spec.batch, key.spec.k)
            batch = step_batch(consts, SamplingFlags(), self.pool, None)  # greedy, nothing else
            self.constants[key] = consts, batch
            g = Captured(lambda key=key, c=consts, b=batch: self._sample(key, c, b), pool)
            pool = g.pool
            self.graphs[key] = g
        torch.cuda.synchronize()
        return pool

    def run(self, key: SampleKey, dev: StepInputs[Tensor], num_rows: int) -> Tensor:
        """The tokens of the step's `num_rows` rows (the eager sampling's) from its resolved
        inputs: copies (the padding rows' constants too, when the rows do not fill the batch),
        a replay."""
        b, n, m = key.spec.batch, key.spec.num_tokens, num_rows * (key.spec.k + 1)
        self.reqs[:num_rows].copy_(dev.spec_reqs)
        self.sample_pool_idx[:m].copy_(dev.sample_pool_idx)
        self.sample_seq_lens[:m].copy_(dev.sample_seq_lens)
        if num_rows < b:
            pool_idx, seq_lens = self.padding[key.spec.k]
            self.reqs[num_rows:b].fill_(self.scratch_row)
            self.sample_pool_idx[m:n].copy_(pool_idx[m:n])
            self.sample_seq_lens[m:n].copy_(seq_lens[m:n])
        out = self.graphs[key].replay()
        self.replays += 1
        return out[:m]
