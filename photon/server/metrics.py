"""Prometheus metrics: vLLM's names under the `photon:` prefix, in a per-app registry.

Everything is observed on the engine thread (`EngineObserver`), never scraped from it:
- gauges `num_requests_running` / `num_requests_waiting` (sequences: an n=4 request counts 4),
  `kv_cache_usage_perc` (blocks held by live requests / usable blocks, `KVCacheManager.usage`; free
  blocks that still hold a cached prefix do not count), `prefix_cache_evictable_blocks` (those);
- counters `prefix_cache_queries` / `prefix_cache_hits` (tokens), `num_preemptions`,
  `kv_events_dropped` (KV event batches the publisher's full queue dropped, --kv-events-config),
  `prompt_tokens` / `generation_tokens`, `request_success{finished_reason}` (one per completion
  choice, as vLLM's V1 counts parallel-sampling children);
- speculative decoding (with `--speculative-config`): counters `spec_decode_num_drafts` (rows
  that verified drafts), `spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens` and
  `spec_decode_num_accepted_tokens_per_pos{position}` (0 = the first draft); the mean acceptance
  length is 1 + accepted_tokens / drafts;
- prefill/decode disaggregation (with `--kv-transfer-config`): photon.server.metrics_kv;
- LoRA adapters (with `--enable-lora`): photon.server.metrics_lora;
- histograms `time_to_first_token_seconds`, `inter_token_latency_seconds`,
  `e2e_request_latency_seconds` (from the HTTP arrival), `request_queue_time_seconds` (engine
  arrival to first scheduling), and `step_time_seconds` (one `EngineCore.step()` call);
- `gpu_idle_fraction`: over windows of about `idle_window_s`, the share of the engine thread's
  time *with work pending* that was spent outside `EngineCore.step()`: the host gap between the end
  of one step and the start of the next (draining commands, handing outputs to the HTTP loop,
  metrics, GIL waits). Idle time with no requests is excluded. It is a host-side proxy: it does
  not see device bubbles inside a step (`photon bench bubble` measures those).
"""

from __future__ import annotations

import os
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from photon.engine.async_engine import TrackedRequest
from photon.engine.engine_core import EngineStats
from photon.outputs import RequestOutput
from photon.server.metrics_kv import KVTransferMetrics
from photon.server.metrics_lora import LoRAMetrics
from photon.spec.stats import SpecDecodingStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                 1.0, 2.0)


class ServerMetrics:
    def __init__(self, model_name: str, idle_window_s: float = 1.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._idle_window_s = idle_window_s
        self._window_start = time.monotonic()
        self._gap_s = 0.0
        self._busy_s = 0.0
        self._last: EngineStats | None = None
        self._make_gauges(model_name)
        self._make_counters(model_name)
        self._make_histograms(model_name)
        self.kv_transfer = KVTransferMetrics(self.registry, model_name)
        self.lora = LoRAMetrics(self.registry, model_name)

    def _gauge(self, name: str, doc: str, model: str) -> Gauge:
        # With several API servers only the first sets the engine's gauges (the others keep 0).
        return Gauge(f"photon:{name}", doc, ["model_name"], registry=self.registry,
                     multiprocess_mode="livemax").labels(model)

    def _counter(self, name: str, doc: str, model: str) -> Counter:
        return Counter(f"photon:{name}", doc, ["model_name"], registry=self.registry).labels(model)

    def _histogram(self, name: str, doc: str, model: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"photon:{name}", doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(model)

    def _make_gauges(self, m: str) -> None:
        self.running = self._gauge("num_requests_running", "Sequences in the running batch.", m)
        self.waiting = self._gauge("num_requests_waiting", "Sequences waiting to be scheduled.", m)
        self.kv_usage = self._gauge("kv_cache_usage_perc",
                                    "KV blocks held by live requests (1 = full).", m)
        self.evictable = self._gauge("prefix_cache_evictable_blocks",
                                     "Free KV blocks still holding a cached prefix.", m)
        self.idle = self._gauge("gpu_idle_fraction",
                                "Share of busy engine-thread time spent between steps.", m)

    def _make_counters(self, m: str) -> None:
        self.prefix_queries = self._counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", m)
        self.prefix_hits = self._counter("prefix_cache_hits", "Prompt tokens found cached.", m)
        self.preemptions = self._counter("num_preemptions", "Preemptions (recompute).", m)
        self.kv_events_dropped = self._counter(
            "kv_events_dropped", "KV cache event batches dropped (the publisher's queue was "
            "full).", m)
        self.prompt_tokens = self._counter("prompt_tokens",
                                           "Prompt tokens (counted at the first output token).", m)
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens.", m)
        self.success = Counter("photon:request_success", "Finished completions by reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self._model = m
        self.spec_drafts = self._counter("spec_decode_num_drafts",
                                         "Speculative rows that verified drafts.", m)
        self.spec_draft_tokens = self._counter("spec_decode_num_draft_tokens",
                                               "Draft tokens verified.", m)
        self.spec_accepted = self._counter("spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted.", m)
        self.spec_accepted_per_pos = Counter(
            "photon:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, per draft position (0: the first draft).",
            ["model_name", "position"], registry=self.registry)

    def _make_histograms(self, m: str) -> None:
        b = _LATENCY_BUCKETS
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.", m, b)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between tokens.", m, b)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Request latency.", m, b)
        self.queue_time = self._histogram("request_queue_time_seconds",
                                          "Time waiting before first scheduled.", m, b)
        self.step_time = self._histogram("step_time_seconds", "One engine step.", m,
                                         _STEP_BUCKETS)

    # ---- EngineObserver (engine thread) -------------------------------------------------------
    def on_step(self, step_s: float | None, gap_s: float | None, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.evictable.set(stats.num_evictable_blocks)
        self._count_deltas(stats)
        if step_s is not None:
            self.step_time.observe(step_s)
            self._update_idle(step_s, gap_s or 0.0)

    def _count_deltas(self, stats: EngineStats) -> None:
        last = self._last
        if last is not None:
            self.prefix_queries.inc(max(0, stats.prefix_queries - last.prefix_queries))
            self.prefix_hits.inc(max(0, stats.prefix_hits - last.prefix_hits))
            self.preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
            self.kv_events_dropped.inc(max(0, stats.kv_events_dropped - last.kv_events_dropped))
        else:
            self.prefix_queries.inc(stats.prefix_queries)
            self.prefix_hits.inc(stats.prefix_hits)
            self.preemptions.inc(stats.num_preemptions)
            self.kv_events_dropped.inc(stats.kv_events_dropped)
        self._count_spec(stats.spec_decoding, last.spec_decoding if last is not None else None)
        self.kv_transfer.count(stats.kv_transfer, last.kv_transfer if last is not None else None)
        self.lora.update(stats.lora, last.lora if last is not None else None)
        self._last = stats

    def _count_spec(self, now: SpecDecodingStats | None, last: SpecDecodingStats | None) -> None:
        if now is None:
            return
        new = now if last is None else now.since(last)
        self.spec_drafts.inc(max(0, new.num_drafts))
        self.spec_draft_tokens.inc(max(0, new.num_draft_tokens))
        self.spec_accepted.inc(max(0, new.num_accepted_tokens))
        for pos, n in enumerate(new.num_accepted_tokens_per_pos):
            self.spec_accepted_per_pos.labels(self._model, str(pos)).inc(max(0, n))

    def _update_idle(self, step_s: float, gap_s: float) -> None:
        self._busy_s += step_s
        self._gap_s += gap_s
        now = time.monotonic()
        if now - self._window_start >= self._idle_window_s:
            total = self._busy_s + self._gap_s
            self.idle.set(self._gap_s / total if total > 0 else 0.0)
            self._window_start, self._busy_s, self._gap_s = now, 0.0, 0.0

    def on_output(self, entry: TrackedRequest, output: RequestOutput, now: float) -> None:
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
            if entry.first_token_time is None:
                entry.first_token_time = now
                self.ttft.observe(now - entry.arrival_time)
                self.prompt_tokens.inc(entry.num_prompt_tokens)
                self._observe_queue_time(output)
            elif entry.last_token_time is not None:
                self.itl.observe(now - entry.last_token_time)
            entry.last_token_time = now
        for c in output.outputs:
            if c.finish_reason is not None:
                self.success.labels(self._model, c.finish_reason).inc()
        if output.finished:
            self.e2e.observe(now - entry.arrival_time)

    def _observe_queue_time(self, output: RequestOutput) -> None:
        m = output.metrics
        if m is not None and m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))

    def render(self) -> bytes:
        """This server's metrics; with several API servers (PROMETHEUS_MULTIPROC_DIR set), all
        of theirs: counters and histograms summed, the engine's gauges from the first."""
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)


class RequestMetricsOnly:
    """An observer that passes on per-request events only: the API servers after the first
    leave the engine's gauges and counters (the same for every server) to the first."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def on_step(self, step_s: float | None, gap_s: float | None, stats: EngineStats) -> None:
        pass

    def on_output(self, entry: TrackedRequest, output: RequestOutput, now: float) -> None:
        self.metrics.on_output(entry, output, now)
