"""CUDA graphs for speculative decode steps, and the runner's set of graphs (`StepGraphs`).

A speculative decode step (every row a speculative row verifying the same K_eff >= 1 drafts: the
scheduler picks one K_eff per step) has K_eff + 1 query tokens per row, so it is captured like a
decode step: `SpecKey(padded batch, block-table width, K_eff)`. The launch resolves the rows'
positions, pool entries, KV slots and seq_lens from the device's known lengths into the slot's
views (photon.worker.spec_step.SpecDecoder.resolve), then `run()` copies them into the static
buffers and replays. Padding rows are no speculative rows, so resolve never touches them and
they never sample: their K_eff + 1 tokens sit at position 0, read pool entry 0 and write K/V
only into slot 0 of the null block 0; the device lengths (`dev_len`) and the token-pool rows of
real requests are never written by them.

Attention in the graph runs the backend's varlen path with host values that are static bounds:
every row has K_eff + 1 query tokens (the kernel's grid), `seq_lens_host` is max_model_len and
`seq_lens_exact` False, so the kernel reads the resolved lengths from the device. Only backends
that declare `varlen_capturable` (their varlen path reads no device value on the host) get
speculative graphs; the others run these steps eagerly.

K_eff = 0 steps are decode-only and use the decode graphs. Which K_eff >= 1 are captured, all
at start-up (a capture synchronises the device, so it cannot happen while steps are in flight):
every 1..K with the adaptive switch on (it may pick any of them, and an eager step would also
skew the step times its cost model measures for that K_eff), only K with it off (every step
verifies K). The batch buckets are powers of two (coarser than the decode graphs': each graph
holds K_eff + 1 times the tokens), capped by the token budget: a step of B rows holds
B * (K_eff + 1) <= max_num_batched_tokens tokens. Every other step runs eagerly.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from photon.attention.backend import AttentionMetadata
from photon.config import EngineConfig
from photon.core.inputs import StepInputs
from photon.core.step import ScheduledRow
from photon.worker.cuda_graph import (
    Captured,
    DecodeGraphs,
    GraphModel,
    copy_inputs,
    pad_rows,
    static_buffers,
    width_buckets,
)
from photon.worker.inputs import HostStep


@dataclass(frozen=True, slots=True)
class SpecKey:
    batch: int  # padded rows
    width: int  # block-table width bucket
    k: int  # K_eff: every row queries k + 1 tokens

    @property
    def num_tokens(self) -> int:
        return self.batch * (self.k + 1)


def spec_batch_buckets(max_batch: int, max_tokens: int, k: int) -> list[int]:
    """Powers of two up to the most rows a step verifying `k` drafts can have, and that most."""
    cap = min(max_batch, max_tokens // (k + 1))
    if cap < 1:
        return []
    return sorted({1 << i for i in range(cap.bit_length()) if 1 << i <= cap} | {cap})


def captured_ks(k: int, adaptive: bool) -> list[int]:
    """The K_eff values with speculative graphs (see the module docstring)."""
    return list(range(1, k + 1)) if adaptive else [k]


def uniform_spec_k(rows: list[ScheduledRow]) -> int | None:
    """K_eff when every row is a speculative row verifying the same K_eff drafts, else None."""
    if not rows:
        return None
    k = rows[0].spec
    if all(r.speculative and r.sample and r.spec == k and r.num_tokens == k + 1 for r in rows):
        return k
    return None


class SpecGraphs:
    def __init__(self, fwd: GraphModel, ks: list[int], max_batch: int, max_tokens: int,
                 max_blocks: int, max_model_len: int, device: torch.device) -> None:
        self.fwd = fwd
        self.max_model_len = max_model_len
        self.batches = {k: b for k in ks if (b := spec_batch_buckets(max_batch, max_tokens, k))}
        self.widths = width_buckets(max_blocks, fwd.backend)
        rows = max((b[-1] for b in self.batches.values()), default=1)
        tokens = max((b[-1] * (k + 1) for k, b in self.batches.items()), default=1)
        self.static = static_buffers(tokens, rows, self.widths, device)
        i32 = dict(dtype=torch.int32, device=device)
        self.query_start_loc = {k: torch.arange(b[-1] + 1, **i32) * (k + 1)
                                for k, b in self.batches.items()}
        self.graphs: dict[SpecKey, Captured] = {}
        self.replays = 0

    def bucket(self, k: int | None, num_rows: int, width: int) -> SpecKey | None:
        """The graph of a speculative decode step of `num_rows` rows each verifying `k` drafts
        (None: not such a step), or None: it runs eagerly."""
        batches = self.batches.get(k) if k is not None else None
        if not batches or num_rows > batches[-1] or width > self.widths[-1]:
            return None
        return SpecKey(batches[bisect.bisect_left(batches, num_rows)],
                       self.widths[bisect.bisect_left(self.widths, width)], k)

    def block_tables(self, key: SpecKey) -> torch.Tensor:
        """The static block tables [batch, width] of `key`'s graph (the replayed step's rows',
        zeros for its padding rows)."""
        return self.static.block_tables[key.width][:key.batch]

    def metadata(self, key: SpecKey) -> AttentionMetadata:
        """The captured attention metadata: device tensors and static host bounds only."""
        s, n = self.static, key.num_tokens
        return AttentionMetadata(
            slot_mapping=s.slot_mapping[:n], block_tables=self.block_tables(key),
            seq_lens=s.seq_lens[:key.batch],
            query_start_loc=self.query_start_loc[key.k][:key.batch + 1],
            seq_lens_host=[self.max_model_len] * key.batch,
            query_lens_host=[key.k + 1] * key.batch, decode_only=False, seq_lens_exact=False)

    def _forward(self, key: SpecKey) -> torch.Tensor:
        n = key.num_tokens
        return self.fwd.forward(self.metadata(key), self.static.pool_idx[:n],
                                self.static.positions[:n])

    def keys(self) -> list[SpecKey]:
        """Every captured key, most tokens first (smaller graphs reuse the pool's memory)."""
        keys = [SpecKey(b, w, k) for k, bs in self.batches.items() for b in bs
                for w in self.widths]
        return sorted(keys, key=lambda key: (-key.num_tokens, -key.width))

    @torch.inference_mode()
    def capture(self, pool: tuple | None = None) -> tuple | None:
        torch.cuda.synchronize()
        for key in self.keys():
            # Padding-like lengths for the warm-up: each row sees its own query positions.
            self.static.seq_lens.fill_(key.k + 1)
            g = Captured(lambda key=key: self._forward(key), pool)
            pool = g.pool
            self.graphs[key] = g
        self.static.seq_lens.fill_(1)
        torch.cuda.synchronize()
        return pool

    def run(self, key: SpecKey, dev: StepInputs[torch.Tensor], num_rows: int) -> torch.Tensor:
        copy_inputs(self.static, dev, key.num_tokens, key.batch, key.width)
        out = self.graphs[key].replay()
        self.replays += 1
        return out[:num_rows * (key.k + 1)]


class LeanKey(NamedTuple):
    """A decode graph without the draft model's catch-up: a step that skips it
    (HostStep.skip_draft, photon.worker.draft_lag)."""

    batch: int
    width: int


GraphKey = tuple[int, int] | LeanKey | SpecKey


class StepGraphs:
    """A runner's CUDA graphs: decode graphs for decode-only steps (speculative rows with K_eff
    = 0 included), speculative graphs for speculative decode steps; other steps run eagerly.
    With a draft model the decode graphs come twice: with the draft's catch-up and without it
    (`lean`, for steps with speculation off)."""

    def __init__(self, decode: DecodeGraphs, spec: SpecGraphs | None,
                 lean: DecodeGraphs | None = None) -> None:
        self.decode = decode
        self.spec = spec
        self.lean = lean

    @classmethod
    def build(cls, fwd: GraphModel, config: EngineConfig, max_blocks: int,
              device: torch.device) -> StepGraphs:
        sched, spec = config.scheduler, config.speculative_config
        decode = DecodeGraphs(fwd, sched.max_num_seqs, max_blocks, device)
        spec_graphs = None
        if spec is not None and getattr(fwd.backend, "varlen_capturable", False):
            spec_graphs = SpecGraphs(fwd, captured_ks(spec.k, spec.adaptive), sched.max_num_seqs,
                                     sched.max_num_batched_tokens, max_blocks,
                                     config.model.max_model_len, device)
        lean = None
        if fwd.draft is not None:
            lean = DecodeGraphs(replace(fwd, draft=None), sched.max_num_seqs, max_blocks, device)
        return cls(decode, spec_graphs, lean)

    @property
    def replays(self) -> int:
        return self.decode.replays + self.spec_replays + self.lean_replays

    @property
    def lean_replays(self) -> int:
        return 0 if self.lean is None else self.lean.replays

    @property
    def spec_replays(self) -> int:
        return 0 if self.spec is None else self.spec.replays

    def capture(self) -> None:
        pool = None if self.spec is None else self.spec.capture()
        pool = self.decode.capture(pool)
        if self.lean is not None:
            self.lean.capture(pool)

    def plan(self, rows: list[ScheduledRow], host: HostStep) -> GraphKey | None:
        """The graph of a prepared step, its host inputs padded in place to it; None: eager."""
        width = host.inputs.block_tables.shape[1]
        if host.decode_only:
            key = self.decode.bucket(len(rows), width)
            if key is not None:
                pad_rows(host.inputs, *key, 1)
                if host.skip_draft and self.lean is not None:
                    return LeanKey(*key)
            return key
        k = host.spec_k if host.uniform_spec else None  # build_spec_inputs' steps
        key = self.spec.bucket(k, len(rows), width) if self.spec is not None else None
        if key is not None:
            pad_rows(host.inputs, key.batch, key.width, key.k + 1)
        return key

    def run(self, key: GraphKey, dev: StepInputs[torch.Tensor], num_rows: int) -> torch.Tensor:
        if isinstance(key, SpecKey):
            return self.spec.run(key, dev, num_rows)
        if isinstance(key, LeanKey):
            return self.lean.run(key, dev, num_rows)
        return self.decode.run(key, dev, num_rows)
