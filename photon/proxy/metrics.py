"""The proxy's Prometheus metrics (per-app registry, `photon:proxy_` names):
- `requests{endpoint}`: client requests;
- `backend_errors{pool, reason}`: failed hops, by pool (prefill / decode) and reason
  (`unreachable`: no connection; `timeout`: silent past --timeout; `status`: an error answer;
  `stream`: a stream broken off; `invalid`: an answer that is not what the protocol says);
- histograms `prefill_seconds` (the prefill hop) and `decode_seconds` (the decode hop, to the
  end of its stream)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
            160.0, 640.0)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("photon:proxy_requests", "Client requests by endpoint.",
                                ["endpoint"], registry=self.registry)
        self.errors = Counter("photon:proxy_backend_errors", "Failed hops by pool and reason.",
                              ["pool", "reason"], registry=self.registry)
        self.hop_seconds = {
            pool: Histogram(f"photon:proxy_{pool}_seconds", f"Time in the {pool} hop.",
                            buckets=_BUCKETS, registry=self.registry)
            for pool in ("prefill", "decode")}

    def error(self, pool: str, reason: str) -> None:
        self.errors.labels(pool, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
