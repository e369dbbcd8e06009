"""Router: the one owner of the router's state (backends, prefix index, policy, event
subscribers, the HTTP client) and the choice of a backend for a request.

Everything here runs on the event loop except the subscribers' threads, which only write the
PrefixIndex (under its lock, with no I/O)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq

from photon.router.backends import (
    Backend,
    BackendPool,
    Listed,
    file_mtime,
    normalize_url,
    read_backends_file,
)
from photon.router.events import BlockKey, EventDecoder, decode_event_batch
from photon.router.hashing import BlockHasher, default_block_hasher
from photon.router.health import probe_health, probe_load
from photon.router.index import PrefixIndex
from photon.router.metrics import RouterMetrics
from photon.router.pending import DEFAULT_PENDING_TTL_S
from photon.router.policies import Candidate, Decision, PolicyConfig, make_policy
from photon.router.prompts import BackendTokenizer, PromptTokenizer
from photon.router.subscriber import EventSubscriber, SubscriberConfig, replay_endpoint_for

log = logging.getLogger("photon.router")


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...] = ()
    backends_file: str | None = None
    # prefill/decode disaggregation (instead of `backends`): the prefill instances, chosen by
    # the policy, and the decode instances, chosen by least load
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    policy: str = "round_robin"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    kv_events: tuple[str, ...] = ()  # one endpoint per backend (prefill); default: host:5557
    block_size: int = 16
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0  # the longest wait for the next byte of a response
    tokenize_timeout_s: float = 5.0
    scrape_metrics: bool = True  # refresh loads from the backends' /metrics gauges
    # prefix_aware: how long a routed prompt's blocks count as cached on its backend before
    # that backend's events confirm them
    pending_ttl_s: float = DEFAULT_PENDING_TTL_S


def _explicit_events(config: RouterConfig) -> dict[str, str]:
    """--kv-events endpoints by backend URL (they pair with --backends, or with --prefill, in
    order)."""
    if not config.kv_events:
        return {}
    flag, urls = ("--prefill", config.prefill) if config.prefill else \
        ("--backends", config.backends)
    if len(config.kv_events) != len(urls):
        raise ValueError(f"--kv-events: give one endpoint per {flag} URL "
                         f"({len(urls)}), got {len(config.kv_events)}")
    return {normalize_url(u): e for u, e in zip(urls, config.kv_events)}


@dataclass(frozen=True)
class RouterParts:
    """What a router can be given instead of its defaults (tests inject fakes)."""
    tokenizer: PromptTokenizer | None = None  # default: the backends' /tokenize
    hasher: BlockHasher | None = None
    decoder: EventDecoder = decode_event_batch
    clock: Callable[[], float] = time.monotonic  # the pending blocks' expiry clock


class Router:
    def __init__(self, config: RouterConfig, parts: RouterParts | None = None) -> None:
        parts = parts or RouterParts()
        self.config = config
        listed = self._listed()
        self.disaggregated = listed.disaggregated
        # The policy chooses in `pool` (the plain backends, or the prefill instances: a
        # prompt's prefix lives where it was prefilled); `decode_pool` is empty unless
        # disaggregated, and chosen by least load.
        self.pool = BackendPool(listed.routed, _explicit_events(config))
        self.decode_pool = BackendPool(listed.decode)
        self.decode_policy = make_policy("least_load")
        self.index = PrefixIndex(config.pending_ttl_s, parts.clock)
        self.policy = make_policy(config.policy, config.policy_config)
        self.metrics = RouterMetrics()
        self.hasher = parts.hasher or default_block_hasher()
        self.decoder = parts.decoder
        self._tokenizer = parts.tokenizer
        self.tokenizer: PromptTokenizer | None = None
        self.subscribers: dict[str, EventSubscriber] = {}
        self.client: httpx.AsyncClient | None = None
        self._zmq: zmq.Context | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._file_mtime = file_mtime(config.backends_file) if config.backends_file else None
        self._reload_requested = False

    # ---- life --------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(
            cfg.request_timeout_s, connect=cfg.connect_timeout_s), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=64))
        self.tokenizer = self._tokenizer or BackendTokenizer(
            self.client, self._any_healthy, cfg.tokenize_timeout_s)
        if self.policy.uses_prefix:
            self._zmq = zmq.Context()
            for url in self.pool.urls():
                self._subscribe(url)
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        for url in list(self.subscribers):
            self._unsubscribe(url)
        if self._zmq is not None:
            self._zmq.term()
        if self.client is not None:
            await self.client.aclose()

    def _subscribe(self, url: str) -> None:
        backend = self.pool.get(url)
        if self._zmq is None or backend is None or not backend.events_endpoint:
            return
        endpoint = backend.events_endpoint
        sub = EventSubscriber(
            SubscriberConfig(url, endpoint, replay_endpoint_for(endpoint),
                             self.config.block_size),
            self.index, self.decoder, self.hasher, self._zmq)
        self.subscribers[url] = sub
        sub.start()

    def _unsubscribe(self, url: str) -> None:
        sub = self.subscribers.pop(url, None)
        if sub is not None:
            sub.stop()
        self.index.drop(url)

    # ---- backends ----------------------------------------------------------------------------
    def _listed(self) -> Listed:
        """The backends of the flags and --backends-file, checked."""
        cfg = self.config
        listed = Listed(cfg.backends, cfg.prefill, cfg.decode)
        if cfg.backends_file:
            listed = listed + read_backends_file(cfg.backends_file)
        return listed.check()

    def backend(self, url: str) -> Backend | None:
        return self.pool.get(url) or self.decode_pool.get(url)

    def urls(self) -> list[str]:
        return self.pool.urls() + self.decode_pool.urls()

    def reload_backends(self) -> None:
        """Re-read --backends-file (SIGHUP, or its mtime changed); a bad file keeps the old list."""
        path = self.config.backends_file
        if path is None:
            return
        self._file_mtime = file_mtime(path)
        try:
            listed = self._listed()
            if listed.disaggregated != self.disaggregated:
                raise ValueError("a reload cannot switch between plain backends and "
                                 "prefill/decode instances (restart the router)")
        except (OSError, ValueError) as e:
            log.error("--backends-file %s not reloaded: %s", path, e)
            return
        added, removed = self.pool.replace(listed.routed)
        more, fewer = self.decode_pool.replace(listed.decode)
        for url in removed:
            self._unsubscribe(url)
        for url in added:
            self._subscribe(url)
        if added or removed or more or fewer:
            log.info("backends reloaded: added %s, removed %s", added + more or "none",
                     removed + fewer or "none")

    def request_reload(self) -> None:
        """Reload --backends-file at the next health tick (safe from a signal handler)."""
        self._reload_requested = True

    def mark_down(self, url: str, why: str) -> None:
        backend = self.backend(url)
        if backend is not None and backend.healthy:
            backend.healthy = False
            log.warning("backend %s is down: %s", url, why)
        self.index.drop(url)  # its cache is gone or unknown

    def _mark_up(self, url: str) -> None:
        backend = self.backend(url)
        if backend is not None and not backend.healthy:
            backend.healthy = True
            log.info("backend %s is up", url)

    def _any_healthy(self) -> str | None:
        up = self.pool.healthy()
        return up[0].url if up else None

    async def _health_loop(self) -> None:
        while True:
            path = self.config.backends_file
            if self._reload_requested or (path is not None
                                          and file_mtime(path) != self._file_mtime):
                self._reload_requested = False
                self.reload_backends()
            results = await asyncio.gather(*(self.check(url) for url in self.urls()),
                                           return_exceptions=True)
            for error in (r for r in results if isinstance(r, Exception)):
                log.error("health check failed: %s: %s", type(error).__name__, error)
            await asyncio.sleep(self.config.health_interval_s)

    async def check(self, url: str) -> None:
        """One health probe (and load scrape) of `url`."""
        assert self.client is not None
        cfg = self.config
        if not await probe_health(self.client, url, cfg.health_timeout_s):
            self.mark_down(url, "its /health did not answer 200")
            return
        self._mark_up(url)
        load = await probe_load(self.client, url, cfg.health_timeout_s) \
            if cfg.scrape_metrics else None
        backend = self.backend(url)
        if load is not None and backend is not None:
            backend.running, backend.waiting = load.running, load.waiting

    # ---- routing -----------------------------------------------------------------------------
    async def prompt_hashes(self, path: str, body: dict[str, Any]) -> list[BlockKey]:
        """The request prompt's block chain (empty unless the policy routes by prefix)."""
        if not self.policy.uses_prefix or self.tokenizer is None:
            return []
        ids = await self.tokenizer.token_ids(path, body)
        return self.hasher(ids, self.config.block_size) if ids else []

    def choose(self, hashes: Sequence[BlockKey], exclude: Sequence[str] = ()) -> Decision | None:
        """The backend for a request whose prompt has the block chain `hashes`; None when no
        healthy backend is left outside `exclude`."""
        up = self.pool.healthy(exclude)
        if not up:
            return None
        cached = self.index.overlap(hashes, [b.url for b in up]) if hashes else {}
        candidates = [Candidate(b.url, b.load, cached.get(b.url, 0)) for b in up]
        decision = self.policy.choose(candidates, len(hashes))
        self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
        if self.policy.uses_prefix:
            self.metrics.prompt_blocks.inc(len(hashes))
            self.metrics.hit_blocks.inc(decision.cached_blocks)
            # In flight counts as cached: the next request sharing this prefix follows it.
            self.index.add_pending(decision.url, hashes)
        return decision

    def choose_decode(self, exclude: Sequence[str] = ()) -> Decision | None:
        """The decode instance for a request (least load); None when no healthy one is left
        outside `exclude`."""
        up = self.decode_pool.healthy(exclude)
        if not up:
            return None
        return self.decode_policy.choose([Candidate(b.url, b.load) for b in up])

    def not_sent(self, url: str, hashes: Sequence[BlockKey]) -> None:
        """The request chosen for `url` failed there before its first byte."""
        self.index.forget_pending(url, hashes)

    def refresh_metrics(self, m: RouterMetrics) -> None:
        m.index_blocks.set(self.index.num_blocks())
        m.pending_blocks.set(self.index.num_pending())
        for backend in [*self.pool, *self.decode_pool]:
            m.healthy.labels(backend.url).set(1 if backend.healthy else 0)
            m.outstanding.labels(backend.url).set(backend.outstanding)
        for url, sub in self.subscribers.items():
            m.event_batches.labels(url).set(sub.stats.batches)
            m.hash_mismatches.labels(url).set(sub.stats.hash_mismatches)
