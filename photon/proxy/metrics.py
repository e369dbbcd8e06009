"""The proxy's Prometheus metrics (per-app registry, `photon:proxy_` names):
- `requests{endpoint}`: client requests;
- `backend_errors{pool, reason}`: failed hops, by pool (prefill / decode) and reason
  (`unreachable`: no connection; `timeout`: silent past --timeout; `status`: an error answer;
  `stream`: a stream broken off; `invalid`: an answer that is not what the protocol says;
  `no_params`: a prefill answer without kv_transfer_params);
- histograms `prefill_seconds` (the prefill hop) and `decode_seconds` (the decode hop, to the
  end of its stream)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from photon.proxy.hops import HopMetrics


class ProxyMetrics(HopMetrics):
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        super().__init__(self.registry, "photon:proxy_", "backend_errors", "pool")
        self.requests = Counter("photon:proxy_requests", "Client requests by endpoint.",
                                ["endpoint"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
