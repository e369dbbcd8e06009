"""What a KV connector's scheduler side tells its worker side each step (carried in the
StepPlan), and the transfer counters. Plain dataclasses of ints, strings and lists: msgspec
encodes them as they are, like the rest of the plan."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class LoadSpec:
    """Load the remote blocks [first_block, first_block + len(block_ids)) of a transfer into
    this instance's `block_ids` (empty: nothing to load, only release the transfer)."""

    key: int  # the request's handle on this instance
    remote_engine_id: str
    remote_request_id: str
    first_block: int
    block_ids: list[int]
    remote_host: str | None = None  # the prefill instance's address (NcclConnector)
    remote_port: int | None = None  # rank 0's
    remote_ports: list[int] = field(default_factory=list)  # rank r's: [r] (may be empty)
    # the prefill instance's blocks that fill block_ids, in order (NixlConnector)
    remote_block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SaveSpec:
    """Save the blocks of a finished prefill for a decode instance."""

    key: int
    transfer_id: str  # the remote_request_id the decode instance is told
    block_ids: list[int]


@dataclass(slots=True)
class KVConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)  # keys whose load stops (aborted)

    @property
    def empty(self) -> bool:
        return not self.loads and not self.saves and not self.cancels


@dataclass
class KVTransferStats:
    """Cumulative transfer counters of one instance (the server's /metrics exports them)."""

    role: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    send_seconds: float = 0.0
    receive_seconds: float = 0.0
    num_sent: int = 0
    num_received: int = 0
    num_load_failures: int = 0  # loads that failed or timed out
    num_expired_leases: int = 0  # saved transfers no decode instance took in time

    def copy(self) -> KVTransferStats:
        return KVTransferStats(**vars(self))


@dataclass(slots=True)
class KVTransferReport:
    """What one tensor-parallel rank's worker side finished since its last report: the keys of
    its finished sends and loads, the blocks of its failed loads, and its counters."""

    sending: list[int] = field(default_factory=list)
    recving: list[int] = field(default_factory=list)
    error_blocks: list[int] = field(default_factory=list)
    stats: KVTransferStats = field(default_factory=KVTransferStats)
