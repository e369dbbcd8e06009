"""The router's Prometheus metrics (`photon_router:` prefix, a per-router registry)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from photon.proxy.hops import HopMetrics


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("photon_router:requests", "Requests sent to a backend.",
                                ["backend"], registry=r)
        self.errors = Counter("photon_router:errors",
                              "Failed backend attempts (connection, timeout, broken stream).",
                              ["backend", "kind"], registry=r)
        self.retries = Counter("photon_router:retries",
                               "Requests retried on another backend before any byte was sent.",
                               registry=r)
        self.decisions = Counter("photon_router:policy_decisions",
                                 "Routing decisions by policy and reason.", ["policy", "reason"],
                                 registry=r)
        self.prompt_blocks = Counter("photon_router:prompt_blocks",
                                     "Full prompt blocks of routed requests (prefix_aware).",
                                     registry=r)
        self.hit_blocks = Counter("photon_router:hit_blocks",
                                  "Prompt blocks already cached (or pending from a routed "
                                  "request) on the chosen backend.",
                                  registry=r)
        self.healthy = Gauge("photon_router:backend_healthy", "1 when the backend is up.",
                             ["backend"], registry=r)
        self.outstanding = Gauge("photon_router:backend_outstanding_requests",
                                 "Requests in flight to the backend.", ["backend"], registry=r)
        self.index_blocks = Gauge("photon_router:index_blocks",
                                  "Distinct KV block hashes in the prefix index.", registry=r)
        self.pending_blocks = Gauge("photon_router:index_pending_blocks",
                                    "Blocks routed to a backend that its KV events have not "
                                    "confirmed yet (they count as cached there).", registry=r)
        self.event_batches = Gauge("photon_router:kv_event_batches",
                                   "KV event batches applied, per backend.", ["backend"],
                                   registry=r)
        self.hash_mismatches = Gauge("photon_router:block_hash_mismatches",
                                     "Chain roots whose hash differs from the router's.",
                                     ["backend"], registry=r)
        # prefill/decode disaggregation: hops sent by role (retries included), failed hops
        # (hop_errors{role, reason}) and the hops' times (prefill_seconds, decode_seconds)
        self.hop_requests = Counter("photon_router:hop_requests",
                                    "Hops sent to a prefill or decode instance.", ["role"],
                                    registry=r)
        self.hops = HopMetrics(r, "photon_router:", "hop_errors", "role")

    def render(self, refresh: Callable[[RouterMetrics], None]) -> bytes:
        """The metrics text after `refresh` has set the gauges from the current state."""
        refresh(self)
        return generate_latest(self.registry)
