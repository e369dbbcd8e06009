"""The planned step and its results: the messages between the scheduler and the model runner.

Request indices: the scheduler gives each admitted request a small integer, `req_index`, unique
among the requests the runner may still touch (running, zombie or preempted ones with a step in
flight). The runner keeps its per-request state (token-pool row, block table, sampling constants)
in a table indexed by it. A request enters the table through `StepPlan.new_requests` (at its
admission, and again when it is readmitted after a preemption) and leaves it through
`StepPlan.released`, once no step in flight reads it; its index may be reused in the same plan.

Every value here is a plain dataclass of ints, floats, bools, tuples and lists: msgspec encodes
and decodes them as they are (tests round-trip a plan), so the plan can be sent to other processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from photon.core.sampling import PackedSampling
from photon.kv_transfer.metadata import KVConnectorMetadata


@dataclass(slots=True)
class NewRequest:
    """A request entering the runner's table at `req_index`."""

    req_index: int
    # Its committed tokens (prompt, then outputs): everything the request knows when it is
    # admitted, since a waiting request has no token in flight. The runner writes those its token
    # pool lacks; later tokens are sampled into the pool on the device.
    token_ids: list[int]
    sampling: PackedSampling
    prompt_logprobs: int = -1  # top-k of the prompt logprobs still to collect; -1: none
    # Speculative requests: after each of its sampling rows the runner proposes this many draft
    # tokens into the pool (0: a plain request).
    spec: int = 0
    # Its LoRA adapter's slot (photon.lora.slots; 0: the base model), held until it is released.
    lora_slot: int = 0


@dataclass(slots=True)
class LoRALoad:
    """Load adapter `lora_int_id` (read from `lora_path`) into device slot `slot` before this
    step's forward: no step in flight reads the slot (its previous adapter's requests are
    released)."""

    slot: int
    lora_int_id: int
    lora_name: str
    lora_path: str


@dataclass(slots=True)
class ScheduledRow:
    """One request's slice of a step: positions [start, start + num_tokens).

    A speculative row (speculative, spec = K_eff) verifies K_eff of the drafts: it queries
    K_eff + 1 positions, the
    request's last known token and the K drafts the runner proposed after its previous sampling
    row. Their positions are resolved on the device from the request's known length there (the
    host plans before the previous step's accepted counts exist): `start` is only the host's upper
    bound of the first query position, so `seq_len` bounds the row's context, and `out_index` is a
    lower bound of the first token's output index. The row commits 1 to K_eff + 1 tokens.
    """

    req_index: int
    start: int
    num_tokens: int
    sample: bool  # the row reaches the request's known length: sample its next token
    out_index: int  # output index of the sampled token (the counter of the RNG)
    block_ids: list[int]  # the request's blocks (in process: the KV manager's list, read-only)
    spec: int = 0  # K_eff: the draft positions this row verifies (0..K)
    # A speculative row: positions resolved on the device (also with K_eff = 0: one query
    # position at the device's length, while the request's earlier rows may be in flight).
    speculative: bool = False

    @property
    def seq_len(self) -> int:
        return self.start + self.num_tokens


@dataclass(slots=True)
class StepPlan:
    step: int = 0  # number of the step (non-empty plans only): the runner's slot is step % 2
    rows: list[ScheduledRow] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)  # enter before the rows run
    released: list[int] = field(default_factory=list)  # leave the table before new_requests
    num_tokens: int = 0
    lora_loads: list[LoRALoad] = field(default_factory=list)  # before the forward runs
    # The runner proposes the next drafts of the step's speculative requests after sampling (the
    # step's K_eff > 0); False: they have none until a later step proposes.
    propose: bool = False
    # The KV connector's loads and saves to start (disaggregation; None without a connector)
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def empty(self) -> bool:
        return not self.rows


@dataclass(slots=True)
class CommittedToken:
    """A sampled token as the host sees it at commit, with its logprobs when the step computed
    them (the top lists hold the step's most alternatives: the scheduler cuts them to what the
    request asked for)."""

    token_id: int
    logprob: float | None = None
    rank: int | None = None  # 1-based rank of the token in the raw distribution
    top_ids: list[int] | None = None  # the top alternatives, most likely first
    top_logprobs: list[float] | None = None


@dataclass(slots=True)
class PromptScores:
    """Logprobs of the prompt tokens [first, first + len(logprobs)) of request `req_index`,
    from one step."""

    req_index: int
    first: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]  # [] per token when no top logprobs were asked for
    top_logprobs: list[list[float]]


def request_table_size(max_num_seqs: int) -> int:
    """Request indices the scheduler hands out (and rows of the runner's table and token pool):
    the running requests, plus finished (zombie) and preempted ones that keep their index while a
    launched step still reads it (at most one step's rows), plus one."""
    return 2 * max_num_seqs + 1
