"""Request: the scheduler-owned state of one sequence.

Token accounting under pipelining (see docs/architecture.md):
- `all_token_ids` holds committed tokens only (prompt + outputs the host has seen).
- `num_pending` counts tokens sampled on the device but not yet committed: between two iterations
  of the loop, at most 1 at depth 1 and at most 2 at depth 2 (the launched step and the staged one).
- `num_computed_tokens` counts positions whose K/V write is planned/enqueued; it is advanced at plan
  time, so stream order guarantees any later step reads those K/V.
- The request's known length is `len(all_token_ids) + num_pending`; a decode row's input is the
  last of those, read from the device token pool.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from photon.core.sampling import PackedSampling
    from photon.engine.detokenizer import IncrementalDetokenizer
    from photon.kv_transfer.params import KVTransferParams
    from photon.lora.request import LoRARequest
    from photon.outputs import PromptLogprobs, SampleLogprobs
    from photon.sampling_params import SamplingParams
    from photon.structured.manager import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # compiling; not admitted until it is ready
    WAITING = "waiting"
    # Its blocks are allocated and a KV connector loads them from a prefill instance; it joins
    # the waiting queue's head (with the loaded tokens computed) when the load ended.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)  # identity: list.remove / index / `in` over the running batch stay cheap
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # resolved: never past max_model_len
    # The sampler's constants (its counter-based RNG key among them: same key + same output index
    # = same noise), packed when the request was added.
    sampling: PackedSampling
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None
    parent_id: str | None = None  # set for the children of an n > 1 request
    index: int = 0  # which of the parent's n samples this is

    # Unique per engine, given by Scheduler.add: the scheduler's and the KV manager's handle of
    # this request (a caller may reuse a request id while the old request's last step runs).
    key: int = -1
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0
    # Speculative decoding: K draft tokens per step (0: plain), fixed at admission. A sampling
    # row in flight adds 1 (plain) to K + 1 (speculative) tokens: num_pending counts the rows,
    # num_pending_max the most tokens they add (the committed length plus it bounds the length
    # on the device).
    spec_k: int = 0
    num_pending_max: int = 0
    # A sampling row was planned since the request entered the runner's table: the device knows
    # its length, so its next rows can be speculative.
    spec_live: bool = False
    # The runner proposes drafts after its last planned sampling row (planned in a step whose
    # K_eff > 0): a speculative row after it has drafts to verify.
    spec_drafted: bool = False
    inflight_refs: int = 0
    finished: bool = False  # output is final and reported; resources wait for inflight_refs == 0
    # Its index in the runner's request table while it holds one (admitted, not yet released).
    req_index: int | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    logprobs: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # [None, then one entry per scored prompt token] when params.prompt_logprobs is set.
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int | None = None  # prefix-cache hit of its first admission
    detokenizer: IncrementalDetokenizer | None = None
    grammar: RequestGrammar | None = None  # structured outputs: compile state, then matcher
    error: str | None = None  # why the request failed (e.g. its grammar did not compile)
    scheduled_time: float | None = None
    first_token_time: float | None = None  # commit of its first output token
    # Disaggregation (photon.kv_transfer): the request's kv_transfer_params, whether its remote
    # load was tried (once: a retry computes locally), whether it holds blocks while waiting
    # (loaded, not yet admitted), whether its blocks outlive it until a transfer is done, and
    # what its output tells the client (the prefill side's transfer).
    kv_transfer_params: KVTransferParams | None = None
    kv_load_done: bool = False
    kv_loaded: bool = False
    kv_delay_free: bool = False
    kv_transfer_params_out: dict[str, Any] | None = None
    # Its LoRA adapter (None: the base model) and the device slot it holds while it holds a
    # request index (0: none)
    lora_request: LoRARequest | None = None
    lora_slot: int = 0
    # Requests of resident adapters admitted past it while it waited for a slot (bounded:
    # photon.lora.slots.SlotGate)
    lora_overtaken: int = 0

    @property
    def block_extra(self) -> tuple[int, ...] | None:
        """What besides its tokens determines its KV: the adapter (prefix-cache keys)."""
        return None if self.lora_request is None else (self.lora_request.lora_int_id,)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def prompt_logprobs_done(self) -> bool:
        """Every prompt token's logprob is collected (or none was asked for)."""
        lps = self.prompt_logprobs
        return lps is None or len(lps) >= len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_committed_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Committed plus sampled-but-uncommitted tokens."""
        return self.num_committed_tokens + self.num_pending

    @property
    def num_planned_outputs(self) -> int:
        return len(self.output_token_ids) + self.num_pending
