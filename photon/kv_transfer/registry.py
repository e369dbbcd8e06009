"""KV_CONNECTORS: `kv_connector` name -> connector class (a lazy photon.registry.Registry: a
connector's module is imported only when a configuration names it)."""

from __future__ import annotations

from photon.registry import Registry

KV_CONNECTORS: Registry[type] = Registry("KV connector", lazy={
    "SharedMemoryConnector": "photon.kv_transfer.shared_memory:SharedMemoryConnector",
    "NcclConnector": "photon.kv_transfer.nccl:NcclConnector",
    "NixlConnector": "photon.kv_transfer.nixl:NixlConnector",
})
