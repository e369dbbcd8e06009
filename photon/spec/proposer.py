"""The proposer interface and registry: who guesses the next K tokens of each request.

A proposer runs on the device inside a step: device tensors in, device tensors out, no host sync
(the invariant of photon.worker.sampler), and every shape a function of (B, K, V, L) only, so a
step can be launched before the host knows the previous step's accepted lengths and can be
captured in a CUDA graph. New methods (EAGLE-style heads, ...) register a class here under the
name `SpeculativeConfig.method` takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from photon.registry import Registry

if TYPE_CHECKING:
    from photon.spec.config import SpeculativeConfig


@dataclass
class ProposeContext:
    """What a proposer may read for a step of B rows; all tensors on one device."""

    # token_pool[pool_rows[b], :seq_lens[b]] are row b's known tokens: prompt + output, the last
    # sampled token included (photon.worker.model_runner's device token pool).
    token_pool: Tensor  # [P, L] int32
    pool_rows: Tensor  # [B] int64
    seq_lens: Tensor  # [B] int64
    k: int  # proposals per row (num_speculative_tokens): the K of every output shape
    # Whether a proposer with a Triton kernel runs it (None: on CUDA when triton imports).
    fused: bool | None = None


@dataclass
class Proposal:
    """Draft tokens for a step. Row b proposes draft_ids[b, :num_draft[b]]; the entries past
    num_draft[b] are 0 (a valid token id, so the verify forward can read them as inputs)."""

    draft_ids: Tensor  # [B, K] int64
    num_draft: Tensor  # [B] int32, in [0, K]
    # q_j(v): the distribution draft_ids[:, j] was drawn from; None: deterministic proposals
    # (q is one-hot at the proposed token), as the n-gram proposer makes.
    draft_probs: Tensor | None  # [B, K, V] float32


class Proposer(Protocol):
    name: str  # the registry name (set by PROPOSERS.register)
    # propose() can be captured in a CUDA graph with the step's sampling (device ops only, no
    # other graph inside it)
    capturable: bool

    def propose(self, ctx: ProposeContext) -> Proposal:
        """Proposals for every row of `ctx`, on its device, without a host sync."""
        ...


# Lazily imported: a configuration that names no method loads none of them.
PROPOSERS: Registry[type] = Registry("speculative method", lazy={
    "draft_model": "photon.spec.draft_model:DraftModelProposer",
    "ngram": "photon.spec.ngram:NgramProposer",
})


def build_proposer(config: SpeculativeConfig, max_model_len: int) -> Proposer:
    """The proposer `config.method` names. Every proposer class is constructed as
    `cls(config, max_model_len)`; a method that needs more (a draft model's weights and KV cache)
    takes it through a method of its own after construction."""
    proposer: Proposer = PROPOSERS.get(config.method)(config, max_model_len)
    return proposer
