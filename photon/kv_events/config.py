"""`KVEventsConfig`: vLLM's `--kv-events-config`, checked.

Keys (vLLM's names and defaults): enable_kv_cache_events (false), publisher ("zmq" when events
are enabled, else "null"), endpoint ("tcp://*:5557": a PUB socket; a `*` host, `ipc://` or
`inproc://` binds, any other address connects), replay_endpoint (none: no replay; an address the
ROUTER replay socket binds), buffer_steps (10000 batches kept for replay), hwm (100000: the PUB
socket's high-water mark), max_queue_size (100000 batches waiting for the publisher thread;
beyond it batches are dropped and counted) and topic (""). With data parallelism, rank r
publishes on the endpoint's port + r (replay_endpoint likewise). Every mistake is a ConfigError
naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from photon.config import ConfigError, json_object_arg

FLAG = "kv_events_config (--kv-events-config)"
PUBLISHERS = ("zmq", "null")
_EXAMPLE = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'
_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _error(key: str, message: str) -> ConfigError:
    return ConfigError(f"{FLAG}: {key} {message}")


def _check_int(key: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _error(key, f"must be an integer >= {low}, got {value!r}")


def _check_endpoint(key: str, value: object) -> None:
    if not isinstance(value, str) or not value.startswith(_SCHEMES):
        raise _error(key, f"must be a ZeroMQ address starting with {', '.join(_SCHEMES)} "
                          f"(e.g. tcp://*:5557), got {value!r}")
    if value.startswith("tcp://"):
        port = value.rpartition(":")[2]
        if port != "*" and (not port.isdigit() or not 0 < int(port) < 65536):
            raise _error(key, f"must end with a port number (tcp://HOST:PORT, or * for any "
                              f"free port), got {value!r}")


@dataclass(frozen=True)
class KVEventsConfig:
    """A checked KV events configuration (from `parse_kv_events_config` or built by hand: the
    fields are checked either way)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are enabled, else "null" (as vLLM)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise _error("enable_kv_cache_events",
                         f"must be true or false, got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise _error("publisher", f"must be one of {', '.join(PUBLISHERS)}; "
                                      f"got {self.publisher!r}")
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
            if self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":*"):
                raise _error("replay_endpoint", f"must differ from endpoint "
                                                f"({self.endpoint!r})")
        _check_int("buffer_steps", self.buffer_steps, 1)
        _check_int("hwm", self.hwm, 0)
        _check_int("max_queue_size", self.max_queue_size, 1)
        if not isinstance(self.topic, str):
            raise _error("topic", f"must be a string, got {self.topic!r}")

    @property
    def publishes(self) -> bool:
        """Whether the engine records and publishes events (enabled, publisher not "null")."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> KVEventsConfig:
        keys = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(keys), key=str)
        if unknown:
            raise ConfigError(f"{FLAG}: unknown key {unknown[0]!r}; allowed keys: "
                              f"{', '.join(keys)}")
        return cls(**values)


def parse_kv_events_config(value: object) -> KVEventsConfig | None:
    """The engine argument as given (a JSON object string from the CLI, a dict from the Python
    API, a KVEventsConfig, or None) -> a checked KVEventsConfig, or None (no events)."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    return KVEventsConfig.from_dict(json_object_arg(value, FLAG, _EXAMPLE))


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The address data-parallel rank `rank` uses (as vLLM): tcp ports + rank (a `*` port stays
    `*`: each rank gets its own free port), inproc names with a `_dp{rank}` suffix, ipc paths
    likewise; rank 0 and None unchanged."""
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if port == "*" else f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"
