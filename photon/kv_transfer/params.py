"""`KVTransferParams`: a request's `kv_transfer_params`, parsed at the edge (vLLM's keys).

To a prefill instance a client sends `{"do_remote_decode": true}`: the request's KV cache is kept
for a decode instance, and its `RequestOutput.kv_transfer_params` says where to find it
(`do_remote_prefill: true`, `remote_engine_id`, `remote_request_id`, `remote_block_ids`,
`remote_host`, `remote_port`, `tp_size`: the prefill instance's tensor-parallel size, and for the
NcclConnector `remote_ports`: the rendezvous port of each of its ranks, `remote_port` being rank
0's). Sent on to a decode instance as they are, those load the KV cache
instead of computing the prompt. Values come from clients: every one is checked, and the ids that
name a transfer may hold only letters, digits, '-' and '_'.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from photon.errors import ParamError

FIELD = "kv_transfer_params"
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_KEYS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids",
         "remote_host", "remote_port", "remote_request_id", "tp_size", "remote_ports")


def _error(key: str, message: str) -> ParamError:
    return ParamError(f"{FIELD}.{key}", f"{FIELD}.{key} {message}")


@dataclass(frozen=True)
class KVTransferParams:
    do_remote_decode: bool = False  # prefill side: keep the KV cache for a decode instance
    do_remote_prefill: bool = False  # decode side: load the KV cache the fields below name
    remote_engine_id: str | None = None
    remote_block_ids: list[int] = field(default_factory=list)
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int | None = None  # the prefill instance's tensor-parallel size
    remote_ports: list[int] = field(default_factory=list)  # rank r's rendezvous: [r] (Nccl)

    @classmethod
    def from_dict(cls, values: object) -> KVTransferParams:
        """Checked params (ParamError naming the key and what is allowed)."""
        if not isinstance(values, Mapping):
            raise ParamError(FIELD, f"{FIELD} must be an object, got {type(values).__name__}")
        unknown = sorted(set(values) - set(_KEYS), key=str)
        if unknown:
            raise _error(str(unknown[0]), f"is not a known key; allowed: {', '.join(_KEYS)}")
        v = dict(values)
        for key in ("do_remote_decode", "do_remote_prefill"):
            if not isinstance(v.get(key, False), bool):
                raise _error(key, f"must be true or false, got {v[key]!r}")
        params = cls(v.get("do_remote_decode", False), v.get("do_remote_prefill", False),
                     _opt_id(v, "remote_engine_id"), _block_ids(v.get("remote_block_ids")),
                     _opt_str(v, "remote_host"), _opt_port(v.get("remote_port")),
                     _opt_id(v, "remote_request_id"), _opt_tp_size(v.get("tp_size")),
                     _ports(v.get("remote_ports")))
        if params.do_remote_decode and params.do_remote_prefill:
            raise _error("do_remote_prefill", "and do_remote_decode cannot both be true")
        if params.do_remote_prefill:
            for key in ("remote_engine_id", "remote_request_id"):
                if getattr(params, key) is None:
                    raise _error(key, "is required with do_remote_prefill (the prefill "
                                      "instance's kv_transfer_params)")
        return params

    def to_dict(self) -> dict[str, Any]:
        return {"do_remote_decode": self.do_remote_decode,
                "do_remote_prefill": self.do_remote_prefill,
                "remote_engine_id": self.remote_engine_id,
                "remote_block_ids": list(self.remote_block_ids),
                "remote_host": self.remote_host, "remote_port": self.remote_port,
                "remote_request_id": self.remote_request_id, "tp_size": self.tp_size,
                "remote_ports": list(self.remote_ports)}


def parse_kv_transfer_params(values: object) -> KVTransferParams | None:
    return None if values is None else KVTransferParams.from_dict(values)


def _opt_id(v: Mapping[str, Any], key: str) -> str | None:
    value = v.get(key)
    if value is not None and (not isinstance(value, str) or not _ID.fullmatch(value)):
        raise _error(key, f"must be 1 to 128 letters, digits, '-' or '_'; got {value!r}")
    return value


def _opt_str(v: Mapping[str, Any], key: str) -> str | None:
    value = v.get(key)
    if value is not None and (not isinstance(value, str) or len(value) > 256):
        raise _error(key, f"must be a string of at most 256 characters, got {value!r}")
    return value


def _is_port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535


def _opt_port(value: object) -> int | None:
    if value is not None and not _is_port(value):
        raise _error("remote_port", f"must be an integer from 0 to 65535, got {value!r}")
    return value


def _ports(value: object) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > 1024 or not all(map(_is_port, value)):
        raise _error("remote_ports", f"must be a list of port numbers (integers from 0 to "
                                     f"65535), one per tensor-parallel rank, got {value!r}")
    return list(value)


def _opt_tp_size(value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 1 <= value <= 1024):
        raise _error("tp_size", f"must be an integer from 1 to 1024, got {value!r}")
    return value


def _block_ids(value: object) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in value):
        raise _error("remote_block_ids", f"must be a list of block ids (integers >= 0), "
                                         f"got {value!r}")
    return list(value)
