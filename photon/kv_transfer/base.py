"""The KV connector interface, split as vLLM's v1 `KVConnectorBase_V1`.

An engine builds two instances of its connector class: the scheduler side (role SCHEDULER, used
by photon.engine.scheduler) and the worker side (role WORKER, used by the model runner, which
never sees requests: it learns each step's work from the `KVConnectorMetadata` in the plan).

Scheduler side, per request:
  get_num_new_matched_tokens  prompt tokens beyond the local prefix-cache hit that can be loaded
                              from a remote instance, and whether they load asynchronously
  update_state_after_alloc    the request's blocks are allocated: plan their load
  build_connector_meta        the step's metadata (loads and saves to start), handed to the runner
  request_finished            (delay_free, kv_transfer_params): whether the blocks must outlive the
                              request until a transfer is done, and what the client is told
Worker side:
  register_kv_caches, start_load_kv, wait_for_layer_load, save_kv_layer, wait_for_save,
  get_finished -> (finished_sending, finished_recving) request keys, and
  get_block_ids_with_load_errors.
With tensor parallelism every rank has a worker side over its own KV shard (tp_rank of
tp_size); the engine learns a transfer finished once every rank's get_finished reported it.
Between them, at start: every rank's get_handshake_metadata goes to the scheduler side's
set_xfer_handshake_metadata, keyed by tensor-parallel rank (vLLM's names).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from photon.kv_transfer.metadata import KVConnectorMetadata, KVTransferStats

if TYPE_CHECKING:
    import torch

    from photon.engine.request import Request
    from photon.kv_transfer.config import KVTransferConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorBase:
    name = ""
    # Whether a decode instance connects to the kv_transfer_params' remote_host (then only to
    # the hosts kv_connector_extra_config.allowed_remote_hosts allows).
    connects_to_remote_host = False

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, engine_id: str,
                 block_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.config = config
        self.block_size = block_size
        self.role = role
        self.engine_id = engine_id  # unique per instance (every rank's is rank 0's)
        # Tensor parallelism: the worker side of rank `tp_rank` moves that rank's KV shard.
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._metadata: KVConnectorMetadata | None = None

    @classmethod
    def check_config(cls, config: KVTransferConfig, tensor_parallel_size: int) -> None:
        """ConfigError if this connector cannot run as configured (checked at start)."""

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def set_xfer_handshake_metadata(self, metadata: dict[int, dict[str, Any]]) -> None:
        """What each rank's worker side's get_handshake_metadata returned (e.g. the address
        its transfers listen on), keyed by tensor-parallel rank (the ranks that returned
        None left out); given once at start."""

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        pass

    def get_handshake_metadata(self) -> dict[str, Any] | None:
        """What peers need to reach this instance's transfers (after register_kv_caches)."""
        return None

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        pass

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    def save_kv_layer(self, layer: int) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self) -> tuple[set[int], set[int]]:
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def has_pending(self) -> bool:
        """Transfers not yet reported by get_finished."""
        return False

    def wait_for_progress(self, timeout: float) -> None:
        """Block up to `timeout` seconds or until a transfer may have finished (the engine calls
        it only when it has nothing else to do)."""

    def stats(self) -> KVTransferStats:
        return KVTransferStats(role=self.config.kv_role)

    def close(self) -> None:
        pass


def create_connector(config: KVTransferConfig, role: KVConnectorRole, engine_id: str,
                     block_size: int, tp_rank: int = 0, tp_size: int = 1) -> KVConnectorBase:
    from photon.kv_transfer.registry import KV_CONNECTORS

    return KV_CONNECTORS.get(config.kv_connector)(config, role, engine_id, block_size,
                                                  tp_rank, tp_size)
