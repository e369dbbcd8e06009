"""The runner's per-step inputs: one schema for the host arrays and their device views.

A step's inputs are built on the host as numpy arrays (`StepInputs[np.ndarray]`, by
photon.worker.inputs and photon.worker.decode_inputs), packed into the slot's two staging buffers in
`INT_FIELDS` / `FLOAT_FIELDS` order, and read on the device through views of the same names
(`StepInputs[torch.Tensor]`). The field list below is the only one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Generic, TypeVar

from photon.core.sampling import FLOAT_COLUMNS

T = TypeVar("T")  # np.ndarray on the host, torch.Tensor on the device


@dataclass(slots=True)
class StepInputs(Generic[T]):
    """All int64 fields first, then the float32 ones (FLOAT_FIELDS), in staging order."""

    # Per token: its position, its input's entry in the device token pool, its K/V slot.
    positions: T
    pool_idx: T
    slot_mapping: T
    write_idx: T  # token-pool entries the host writes (tokens the pool lacks) ...
    write_ids: T  # ... and their token ids
    # Per row.
    seq_lens: T
    query_start_loc: T  # [rows + 1]
    block_tables: T  # [rows, width], staged flat
    logits_indices: T  # the hidden state each sampling row samples from
    # Per sampling row (the rows that sample, in row order; a speculative row has K + 1).
    top_k: T
    keys: T
    counters: T  # output index of the token sampled: the RNG counter
    pool_rows: T  # its token-pool row (= its request index)
    prompt_lens: T
    sample_seq_lens: T  # its known tokens after this step's forward
    sample_pool_idx: T  # where the sampled token goes in the token pool
    ban_rows: T  # (sampling row, token) pairs banned (min_tokens) ...
    ban_tokens: T
    # ... while the row's output index (`counters`, resolved on the device for speculative
    # rows) is below this: the request's min_tokens
    ban_until: T
    bias_rows: T  # (sampling row, token, value) triples added to the logits (logit_bias)
    bias_tokens: T
    # Prompt logprobs: hidden-state index and prompt token of every prompt token scored.
    plp_idx: T
    plp_tokens: T
    # Speculative rows (photon.core.step.ScheduledRow.spec): their row in the step, request index
    # and first sampling row (a speculative row samples K + 1 consecutive sampling rows, one per
    # query position); the launch resolves their positions from the device's known lengths.
    spec_rows: T
    spec_reqs: T
    spec_vrows: T
    # Request indices of the speculative requests that sample this step: the runner proposes
    # their next drafts after sampling.
    propose_reqs: T
    # Per token: its request's LoRA slot (0: the base model).
    lora_slots: T
    # float32, per sampling row.
    temperature: T
    top_p: T
    min_p: T
    presence_penalty: T
    frequency_penalty: T
    repetition_penalty: T
    bias_values: T


FLOAT_FIELDS = (*FLOAT_COLUMNS, "bias_values")
INT_FIELDS = tuple(f.name for f in fields(StepInputs) if f.name not in FLOAT_FIELDS)
assert tuple(f.name for f in fields(StepInputs)) == INT_FIELDS + FLOAT_FIELDS, \
    "StepInputs lists its int64 fields first, then FLOAT_FIELDS in order"


def int_arrays(inputs: StepInputs[T]) -> list[T]:
    return [getattr(inputs, name) for name in INT_FIELDS]


def float_arrays(inputs: StepInputs[T]) -> list[T]:
    return [getattr(inputs, name) for name in FLOAT_FIELDS]


@dataclass(frozen=True, slots=True)
class SamplingFlags:
    """The sampler's switches for one step, from its sampling rows' constants (host values: the
    sampler branches on them without reading the device)."""

    all_greedy: bool = True
    any_top_k: bool = False
    any_top_p: bool = False
    any_min_p: bool = False
    any_penalties: bool = False
    any_logit_bias: bool = False
    max_logprobs: int = -1  # -1: no row wants logprobs
