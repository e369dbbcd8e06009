"""`photon proxy`: prefill/decode disaggregation's front, on its own port."""

from __future__ import annotations

import argparse
from typing import Any

_DESCRIPTION = """\
Serve the OpenAI API in front of prefill and decode instances (photon serve with
--kv-transfer-config, kv_role kv_producer / kv_consumer). Each completions or chat request goes
first to a prefill instance (max_tokens=1, kv_transfer_params {"do_remote_decode": true}), then,
with the kv_transfer_params that instance returns, to a decode instance, whose answer (JSON or
the stream) the client gets unchanged. Within a pool the instance with the fewest requests in
flight is picked (ties in turn); one that cannot be reached is passed over. GET /health is 200
while each pool has a healthy instance, else 503 naming what is down; GET /metrics has the
proxy's own series (photon:proxy_*). The Authorization header goes to the backends as given."""


def add_proxy(sub: Any) -> None:
    from photon.cli import RawDescriptionHelpFormatter

    p = sub.add_parser("proxy", allow_abbrev=False, formatter_class=RawDescriptionHelpFormatter,
                       help="Run the prefill/decode disaggregation proxy.",
                       description=_DESCRIPTION)
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="Base URLs of the prefill instances (http://HOST:PORT, or HOST:PORT).")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="Base URLs of the decode instances.")
    p.add_argument("--host", default="127.0.0.1",
                   help="Address to bind (default 127.0.0.1: local only).")
    p.add_argument("--port", type=int, default=8000, help="Port (default 8000; 0 = any free).")
    p.add_argument("--connect-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="Seconds to connect to a backend (then the next of its pool is tried); "
                        "also the limit of each backend's health check (default 5).")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="Seconds a backend may stay silent: before its answer, or between the "
                        "pieces of a stream; past it the client gets 504, or an error event "
                        "(default 600).")
    p.add_argument("--log-level", default="info", help="uvicorn log level.")
    p.set_defaults(func=run_proxy)


def proxy_config(ns: argparse.Namespace) -> Any:
    from photon.proxy.config import ProxyConfig

    return ProxyConfig(prefill=tuple(ns.prefill), decode=tuple(ns.decode),
                       connect_timeout_s=ns.connect_timeout, timeout_s=ns.timeout)


def run_proxy(ns: argparse.Namespace) -> int:
    """Serve until SIGTERM / Ctrl-C."""
    import uvicorn

    from photon.proxy.app import build_proxy_app

    app = build_proxy_app(proxy_config(ns))
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                timeout_graceful_shutdown=5)
    return 0
