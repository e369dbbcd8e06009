"""`KVTransferConfig`: vLLM's `--kv-transfer-config` / `LLM(kv_transfer_config=...)`, checked.

Keys (vLLM's names): kv_connector (a registered connector, e.g. "SharedMemoryConnector"),
kv_role ("kv_producer": a prefill instance, "kv_consumer": a decode instance, "kv_both"),
kv_connector_extra_config (the connector's own options; photon reads timeout_s, on_failure,
rendezvous, kv_ip / kv_port (where a prefill instance's NcclConnector / NixlConnector listens),
allowed_remote_hosts (the prefill hosts a decode instance's NcclConnector / NixlConnector may
connect to) and the test-only inject_fault). Every
mistake is a ConfigError naming the key and what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from photon.config import ConfigError, json_object_arg
from photon.errors import ParamError

if TYPE_CHECKING:
    from photon.kv_transfer.params import KVTransferParams

FLAG = "kv_transfer_config (--kv-transfer-config)"
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
ON_FAILURE = ("recompute", "fail")
# Test-only fault injection on the producer side: drop: the transfer is never written;
# delay: it is written but never published (the consumer times out).
INJECT_FAULTS = ("none", "drop", "delay")
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RENDEZVOUS = "photon"
_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")
_EXTRA_KEYS = ("timeout_s", "on_failure", "rendezvous", "kv_ip", "kv_port",
               "allowed_remote_hosts", "inject_fault")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
ALLOWED_REMOTE_HOSTS = "kv_connector_extra_config.allowed_remote_hosts"
_NAME = re.compile(r"[A-Za-z0-9_.]{1,64}")
_EXAMPLE = '{"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer"}'


def _error(key: str, message: str) -> ConfigError:
    return ConfigError(f"{FLAG}: {key} {message}")


def _choice(key: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise _error(key, f"must be one of {', '.join(allowed)}; got {value!r}")
    return value


@dataclass(frozen=True)
class KVConnectorExtraConfig:
    """kv_connector_extra_config, checked."""

    # A transfer not finished this long after it started fails (the consumer) or is given up
    # and its blocks freed (the producer's lease).
    timeout_s: float = DEFAULT_TIMEOUT_S
    on_failure: str = "recompute"  # recompute the prefill locally, or fail the request
    # The name both instances meet under on this machine; tests give each pair its own.
    rendezvous: str = DEFAULT_RENDEZVOUS
    # NcclConnector / NixlConnector: the address a prefill instance's rendezvous store (or
    # handshake) listens on (port 0: a free port, chosen at start; with tensor parallelism
    # rank r's is kv_port + r, or a free one each); decode instances learn it from
    # kv_transfer_params.
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    # The hosts a request's kv_transfer_params.remote_host may name ("*": any); None: the
    # loopback hosts and kv_ip (default_remote_hosts).
    allowed_remote_hosts: tuple[str, ...] | None = None
    inject_fault: str = "none"  # test only: see INJECT_FAULTS

    def __post_init__(self) -> None:
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise _error("kv_connector_extra_config.timeout_s",
                         f"must be a number of seconds in (0, 3600], got {t!r}")
        object.__setattr__(self, "timeout_s", float(t))
        _choice("kv_connector_extra_config.on_failure", self.on_failure, ON_FAILURE)
        _choice("kv_connector_extra_config.inject_fault", self.inject_fault, INJECT_FAULTS)
        if not isinstance(self.rendezvous, str) or not _NAME.fullmatch(self.rendezvous):
            raise _error("kv_connector_extra_config.rendezvous",
                         f"must be 1 to 64 letters, digits, '_' or '.'; got {self.rendezvous!r}")
        if not isinstance(self.kv_ip, str) or not 0 < len(self.kv_ip) <= 256:
            raise _error("kv_connector_extra_config.kv_ip",
                         f"must be a host name or IP address, got {self.kv_ip!r}")
        p = self.kv_port
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= 65535:
            raise _error("kv_connector_extra_config.kv_port",
                         f"must be a port number from 0 (a free port) to 65535, got {p!r}")
        if self.allowed_remote_hosts is not None:
            object.__setattr__(self, "allowed_remote_hosts",
                               _host_list(self.allowed_remote_hosts))

    def remote_hosts(self) -> tuple[str, ...]:
        """The hosts a decode instance may connect to (lower case; "*": any)."""
        if self.allowed_remote_hosts is not None:
            return self.allowed_remote_hosts
        return default_remote_hosts(self.kv_ip)

    def allows_remote_host(self, host: str) -> bool:
        allowed = self.remote_hosts()
        return "*" in allowed or host.lower() in allowed

    def host_refusal(self, host: str) -> str | None:
        """Why a decode instance may not connect to `host` (None: it may)."""
        if self.allows_remote_host(host):
            return None
        return (f"kv_transfer_params.remote_host {host!r} is not allowed by "
                f"{ALLOWED_REMOTE_HOSTS} ({', '.join(self.remote_hosts())}); add the prefill "
                f"instance's host there")

    @classmethod
    def from_dict(cls, values: object) -> KVConnectorExtraConfig:
        if not isinstance(values, Mapping):
            raise _error("kv_connector_extra_config", f"must be a JSON object, got {values!r}")
        unknown = sorted(set(values) - set(_EXTRA_KEYS), key=str)
        if unknown:
            raise _error("kv_connector_extra_config", f"has unknown key {unknown[0]!r}; "
                                                      f"allowed keys: {', '.join(_EXTRA_KEYS)}")
        return cls(**values)


def default_remote_hosts(kv_ip: str) -> tuple[str, ...]:
    """The loopback hosts and this instance's own kv_ip (its host name when kv_ip listens on
    every address)."""
    import socket

    own = socket.gethostname() if kv_ip in ("0.0.0.0", "::", "") else kv_ip
    return tuple(dict.fromkeys(h.lower() for h in (*LOOPBACK_HOSTS, own)))


def _host_list(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(h, str) and 0 < len(h) <= 256 for h in value):
        raise _error(ALLOWED_REMOTE_HOSTS, f"must be a non-empty list of host names or IP "
                                           f"addresses (\"*\": any host), got {value!r}")
    return tuple(h.lower() for h in value)


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_connector_extra_config: KVConnectorExtraConfig = KVConnectorExtraConfig()

    def __post_init__(self) -> None:
        from photon.kv_transfer.registry import KV_CONNECTORS

        if not isinstance(self.kv_connector, str) or self.kv_connector not in KV_CONNECTORS:
            raise _error("kv_connector", f"must be one of {', '.join(KV_CONNECTORS.names())}; "
                                         f"got {self.kv_connector!r}")
        _choice("kv_role", self.kv_role, KV_ROLES)

    @property
    def extra(self) -> KVConnectorExtraConfig:
        return self.kv_connector_extra_config

    def check_request(self, params: KVTransferParams, tp_size: int) -> None:
        """A request's kv_transfer_params at the edge, against this instance: ParamError naming
        the key and what is allowed."""
        from photon.kv_transfer.registry import KV_CONNECTORS

        if not params.do_remote_prefill:
            return
        if params.tp_size is not None and params.tp_size != tp_size:
            # each rank loads the shard its own rank of the prefill instance saved
            raise ParamError("kv_transfer_params.tp_size",
                             f"kv_transfer_params.tp_size: the prefill instance runs "
                             f"tensor_parallel_size {params.tp_size}, this instance {tp_size}; "
                             f"both must be equal")
        if not KV_CONNECTORS.get(self.kv_connector).connects_to_remote_host:
            return
        if params.remote_host is not None:  # every rank connects to it
            refusal = self.extra.host_refusal(params.remote_host)
            if refusal is not None:
                raise ParamError("kv_transfer_params.remote_host", refusal)
        if tp_size > 1 and len(params.remote_ports) != tp_size:
            # rank r connects to the rendezvous of the prefill instance's rank r
            raise ParamError("kv_transfer_params.remote_ports",
                             f"kv_transfer_params.remote_ports must name the rendezvous port "
                             f"of each of the prefill instance's {tp_size} ranks (send the "
                             f"prefill instance's kv_transfer_params unchanged); got "
                             f"{params.remote_ports!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> KVTransferConfig:
        unknown = sorted(set(values) - set(_KEYS), key=str)
        if unknown:
            raise ConfigError(f"{FLAG}: unknown key {unknown[0]!r}; allowed keys: "
                              f"{', '.join(_KEYS)}")
        for key in ("kv_connector", "kv_role"):
            if key not in values:
                raise _error(key, f"is required, e.g. {_EXAMPLE}")
        extra = KVConnectorExtraConfig.from_dict(values.get("kv_connector_extra_config") or {})
        return cls(values["kv_connector"], values["kv_role"], extra)


def parse_kv_transfer_config(value: object) -> KVTransferConfig | None:
    """The engine argument as given (a JSON object string, a dict, a KVTransferConfig or None)
    -> a checked KVTransferConfig, or None (no disaggregation)."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    return KVTransferConfig.from_dict(json_object_arg(value, FLAG, _EXAMPLE))
