"""`AddressedConnector`: the connectors whose decode instance connects to the prefill instance
named in kv_transfer_params (NcclConnector, NixlConnector).

Every tensor-parallel rank r of a prefill instance listens on a port of its own (kv_port + r,
or a free port each when kv_port is 0), all on kv_ip; the scheduler side learns the ports from
the ranks' handshake metadata and tells decode instances `remote_host`, `remote_port` (rank
0's) and `remote_ports` (every rank's). Rank r of a decode instance pairs with rank r only, and
connects only to the hosts kv_connector_extra_config.allowed_remote_hosts allows (checked at
the request's edge and again here, before any connection).
"""

from __future__ import annotations

import socket
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from photon.config import ConfigError
from photon.kv_transfer.config import FLAG
from photon.kv_transfer.params import KVTransferParams
from photon.kv_transfer.planner import PlannedConnector

if TYPE_CHECKING:
    from photon.kv_transfer.base import KVConnectorRole
    from photon.kv_transfer.config import KVTransferConfig
    from photon.kv_transfer.metadata import LoadSpec


class AddressedConnector(PlannedConnector):
    connects_to_remote_host = True

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, engine_id: str,
                 block_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, role, engine_id, block_size, tp_rank, tp_size)
        # scheduler side: the producer's host and each rank's port
        self._host: str | None = None
        self._ports: list[int] = []

    # ---- scheduler side -----------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, dict[str, Any]]) -> None:
        ranks = [metadata.get(rank) for rank in range(self.tp_size)]
        if not all(ranks):
            return  # not a producer
        hosts = {m["host"] for m in ranks}
        if len(hosts) > 1:  # kv_transfer_params name one host for every rank
            raise ConfigError(f"{FLAG}: the {self.name} needs every tensor-parallel rank of "
                              f"a prefill instance on one host; its ranks advertise "
                              f"{sorted(hosts)}")
        self._host, self._ports = hosts.pop(), [m["port"] for m in ranks]

    def remote_params(self, transfer_id: str, block_ids: list[int]) -> KVTransferParams:
        return KVTransferParams(do_remote_prefill=True, remote_engine_id=self.engine_id,
                                remote_block_ids=list(block_ids), remote_host=self._host,
                                remote_port=self._ports[0] if self._ports else None,
                                remote_request_id=transfer_id, tp_size=self.tp_size,
                                remote_ports=list(self._ports))

    # ---- worker side --------------------------------------------------------------------------
    def listen_port(self) -> int:
        """The port this rank listens on (0: a free one)."""
        return self.extra.kv_port + self.tp_rank if self.extra.kv_port else 0

    def handshake_metadata(self, port: int) -> dict[str, Any]:
        return {"host": advertised(self.extra.kv_ip), "port": port}

    def refused_load(self, spec: LoadSpec) -> Future[int] | None:
        """A failed load if the spec's host is not allowed (nothing connects), else None."""
        refused = self.extra.host_refusal(spec.remote_host) if spec.remote_host else None
        if refused is None:
            return None
        failed: Future[int] = Future()
        failed.set_exception(PermissionError(refused))
        self._progress.set()
        return failed

    def remote_port(self, spec: LoadSpec) -> int | None:
        """This rank's port on the prefill instance (rank 0's: remote_port)."""
        if self.tp_rank < len(spec.remote_ports):
            return spec.remote_ports[self.tp_rank]
        return spec.remote_port if self.tp_rank == 0 else None

    def address_error(self, spec: LoadSpec) -> str | None:
        """Why the spec names no address of this rank's peer (None: it does)."""
        if spec.remote_host and self.remote_port(spec):
            return None
        return (f"kv_transfer_params name no remote_host and remote_port of the prefill "
                f"instance's rank {self.tp_rank}")


def advertised(host: str) -> str:
    """The address decode instances reach: the host's name when listening on every address."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host
