"""`photon router`: flags, then uvicorn on the router's app until SIGTERM / Ctrl-C."""

from __future__ import annotations

import argparse
import signal
from typing import Any

from photon.router.app import DEFAULT_MAX_BODY
from photon.router.pending import DEFAULT_PENDING_TTL_S
from photon.router.policies import POLICIES, PolicyConfig

DESCRIPTION = """Send each OpenAI request to one of several photon (or vLLM) servers.

Policies: round_robin; least_load (requests in flight, or the backend's own running + waiting
gauges when larger); prefix_aware (the backend whose KV cache already holds most of the
prompt, from the backends' KV cache events: cost = --prefix-weight x prompt blocks to prefill
+ load; ties and overload fall back to least load).

Prefill/decode disaggregation: with --prefill and --decode instead of --backends, each
completions or chat request goes first to the prefill instance the policy chooses (max_tokens=1,
kv_transfer_params {"do_remote_decode": true}), then, with the kv_transfer_params it returns,
to the least loaded decode instance, as `photon proxy` does. See docs/router.md."""


def add_router(sub: Any) -> None:
    from photon.cli import RawDescriptionHelpFormatter

    p = sub.add_parser("router", allow_abbrev=False, help="Route requests over several servers.",
                       description=DESCRIPTION, formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=None, metavar="URL",
                   help="The servers' base URLs (http://host:port).")
    p.add_argument("--prefill", nargs="+", default=None, metavar="URL",
                   help="Prefill instances (disaggregation, instead of --backends): the policy "
                        "chooses among them.")
    p.add_argument("--decode", nargs="+", default=None, metavar="URL",
                   help="Decode instances (with --prefill): the least loaded one decodes.")
    p.add_argument("--backends-file", default=None, metavar="PATH",
                   help="More backends, one a line: URL, or `prefill URL` / `decode URL` "
                        "(# comments); reloaded on SIGHUP and when the file changes.")
    p.add_argument("--policy", default="least_load", choices=POLICIES.names(),
                   help="How to choose a backend.")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    p.add_argument("--port", type=int, default=8000, help="Port (0 = any free).")
    p.add_argument("--kv-events", nargs="+", default=None, metavar="ENDPOINT",
                   help="prefix_aware: each backend's KV events endpoint, in --backends (or "
                        "--prefill) order "
                        "(default: tcp://BACKEND_HOST:5557; the replay socket is at port + 1).")
    p.add_argument("--block-size", type=int, default=16,
                   help="prefix_aware: the backends' KV block size in tokens.")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="prefix_aware: the served model's directory (or built-in name) to "
                        "tokenize prompts with (default: ask a backend's /tokenize).")
    _add_tuning(p)
    p.set_defaults(func=run_router)


def _add_tuning(p: argparse.ArgumentParser) -> None:
    d = PolicyConfig()
    p.add_argument("--prefix-weight", type=float, default=d.prefix_weight,
                   help="prefix_aware: load units one prompt block to prefill costs.")
    p.add_argument("--balance-threshold", type=float, default=d.balance_threshold,
                   help="prefix_aware: load above the least loaded backend's beyond which the "
                        "least loaded one gets the request.")
    p.add_argument("--pending-ttl", type=float, default=DEFAULT_PENDING_TTL_S, metavar="S",
                   help="prefix_aware: seconds a routed prompt's blocks count as cached on its "
                        "backend until that backend's KV events confirm (or remove) them.")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="S",
                   help="Seconds between health checks (a dead backend is out within about "
                        "interval + timeout).")
    p.add_argument("--health-timeout", type=float, default=1.0, metavar="S",
                   help="Seconds a health check waits.")
    p.add_argument("--connect-timeout", type=float, default=5.0, metavar="S",
                   help="Seconds to connect to a backend.")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="Seconds to wait for a backend's next response byte.")
    p.add_argument("--scrape-metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="Refresh the backends' loads from their /metrics at each health check.")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY,
                   help="Answer 413 for larger request bodies (default 16 MiB).")
    p.add_argument("--log-level", default="info", help="uvicorn log level.")


def router_config(ns: argparse.Namespace) -> Any:
    from photon.router.router import RouterConfig

    for name in ("block_size", "max_request_body_bytes"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    for name in ("health_interval", "health_timeout", "connect_timeout", "request_timeout",
                 "pending_ttl"):
        if not getattr(ns, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(ns, name)}")
    if ns.prefix_weight < 0 or ns.balance_threshold < 0:
        raise ValueError("--prefix-weight and --balance-threshold must be >= 0")
    return RouterConfig(
        backends=tuple(ns.backends or ()), backends_file=ns.backends_file,
        prefill=tuple(ns.prefill or ()), decode=tuple(ns.decode or ()), policy=ns.policy,
        policy_config=PolicyConfig(ns.prefix_weight, ns.balance_threshold),
        kv_events=tuple(ns.kv_events or ()), block_size=ns.block_size,
        health_interval_s=ns.health_interval, health_timeout_s=ns.health_timeout,
        connect_timeout_s=ns.connect_timeout, request_timeout_s=ns.request_timeout,
        scrape_metrics=ns.scrape_metrics, pending_ttl_s=ns.pending_ttl)


def _local_tokenizer(name: str | None) -> Any:
    if name is None:
        return None
    from photon.model.tiny import resolve_model_path
    from photon.router.prompts import LocalTokenizer
    from photon.tokenizer import Tokenizer

    return LocalTokenizer(Tokenizer.from_pretrained(resolve_model_path(name)))


def run_router(ns: argparse.Namespace) -> int:
    import uvicorn

    from photon.router.app import build_router_app
    from photon.router.router import Router, RouterParts

    router = Router(router_config(ns), RouterParts(tokenizer=_local_tokenizer(ns.tokenizer)))
    app = build_router_app(router, ns.max_request_body_bytes)
    signal.signal(signal.SIGHUP, lambda *_: router.request_reload())
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                timeout_graceful_shutdown=5)
    return 0
