"""Prometheus series of prefill/decode disaggregation (`--kv-transfer-config`), fed from the
cumulative `KVTransferStats` each step's EngineStats carries:
- `kv_transfer_role{role}`: 1 for the instance's kv_role (kv_producer, kv_consumer, kv_both);
- counters `kv_transfer_bytes{direction}` and `kv_transfer_seconds{direction}` (sent: saved for a
  decode instance, received: loaded from a prefill instance), `kv_transfer_requests{direction}`,
  `kv_transfer_load_failures` (loads that failed or timed out: recomputed or failed per
  on_failure) and `kv_transfer_expired_leases` (saved KV no decode instance took in time).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from photon.kv_transfer.metadata import KVTransferStats


class KVTransferMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        labels = ["model_name", "direction"]
        self._model = model
        self.role = Gauge("photon:kv_transfer_role", "1 for this instance's kv_role.",
                          ["model_name", "role"], registry=registry, multiprocess_mode="livemax")
        self.bytes = Counter("photon:kv_transfer_bytes", "KV cache bytes transferred.", labels,
                             registry=registry)
        self.seconds = Counter("photon:kv_transfer_seconds", "Time spent transferring KV.",
                               labels, registry=registry)
        self.requests = Counter("photon:kv_transfer_requests", "Requests whose KV was "
                                "transferred.", labels, registry=registry)
        self.failures = Counter("photon:kv_transfer_load_failures", "KV loads that failed or "
                                "timed out.", ["model_name"], registry=registry).labels(model)
        self.expired = Counter("photon:kv_transfer_expired_leases", "Saved KV no decode "
                               "instance took in time.", ["model_name"],
                               registry=registry).labels(model)
        self._role_set = False

    def count(self, now: KVTransferStats | None, last: KVTransferStats | None) -> None:
        """Add what changed since the previous step's cumulative counters."""
        if now is None:
            return
        if not self._role_set and now.role:
            self.role.labels(self._model, now.role).set(1)
            self._role_set = True
        last = last or KVTransferStats()
        m = self._model
        for direction, b, s, n in (
                ("sent", "bytes_sent", "send_seconds", "num_sent"),
                ("received", "bytes_received", "receive_seconds", "num_received")):
            self.bytes.labels(m, direction).inc(max(0, getattr(now, b) - getattr(last, b)))
            self.seconds.labels(m, direction).inc(max(0.0, getattr(now, s) - getattr(last, s)))
            self.requests.labels(m, direction).inc(max(0, getattr(now, n) - getattr(last, n)))
        self.failures.inc(max(0, now.num_load_failures - last.num_load_failures))
        self.expired.inc(max(0, now.num_expired_leases - last.num_expired_leases))
