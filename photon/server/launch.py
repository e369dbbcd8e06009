"""`photon serve`: build the engine, the app and run uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

DEFAULT_MAX_BODY = 16 * 1024 * 1024


def add_serve(sub: Any) -> None:
    from photon.cli import add_engine_args

    p = sub.add_parser("serve", allow_abbrev=False, help="Run the OpenAI-compatible HTTP server.",
                       description="Serve the model over an OpenAI-compatible HTTP API.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="The model to serve, as vLLM's `vllm serve MODEL`: a built-in name "
                        "(photon-tiny, photon-tiny-draft, photon-tiny-random), a local directory "
                        "or a Hugging Face hub id (the same as --model).")
    p.add_argument("--host", default="127.0.0.1",
                   help="Address to bind (default 127.0.0.1: local only).")
    p.add_argument("--port", type=int, default=8000, help="Port (default 8000; 0 = any free).")
    p.add_argument("--api-key", default=None,
                   help="Require `Authorization: Bearer KEY` (default: $PHOTON_API_KEY, if set).")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="How many sequences (prompts x n) may wait beyond the --max-num-seqs "
                        "that run at once; further requests get 429 with Retry-After "
                        "(default 1024). With --api-server-count N the limit is the whole "
                        "server's: the API servers share one count.")
    p.add_argument("--max-prompts-per-request", type=int, default=256,
                   help="Answer 400 for a completions request with more prompts than this "
                        "(default 256).")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY,
                   help="Answer 413 for larger request bodies (default 16 MiB).")
    p.add_argument("--allowed-origins", nargs="*", default=None,
                   help="Enable CORS for these origins (default: CORS off).")
    p.add_argument("--log-level", default="info", help="uvicorn log level.")
    p.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="API server processes on the port, all feeding one engine core: more "
                        "of them keep up with more concurrent streams (default 1).")
    p.add_argument("--chat-template", default=None, metavar="PATH|TEMPLATE",
                   help="The chat template for /v1/chat/completions: a Jinja file's path or the "
                        "template itself (default: the model's own).")
    _add_tool_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def _add_tool_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='Allow tool_choice "auto" (the default when a request gives tools): the '
                        "model decides whether to call tools; needs --tool-call-parser.")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="How to read tool calls out of the model's text: hermes (Hermes, "
                        "Qwen2.5, Qwen3), llama3_json (Llama 3.x JSON calls) or mistral.")


def _check_tool_args(ns: argparse.Namespace) -> None:
    from photon.server.tool_parsers import get_tool_parser, tool_parser_names

    if ns.tool_call_parser is not None:
        try:
            get_tool_parser(ns.tool_call_parser)
        except ValueError as e:
            raise ValueError(f"--tool-call-parser: {e}") from None
    elif ns.enable_auto_tool_choice:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of: "
                         f"{', '.join(tool_parser_names())})")


def server_config(ns: argparse.Namespace, served_model_name: str, max_model_len: int) -> Any:
    from photon.server.openai_serving import ServerConfig
    from photon.tokenizer import resolve_chat_template

    for name in ("max_queued_requests", "max_prompts_per_request", "max_request_body_bytes"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    _check_tool_args(ns)
    return ServerConfig(served_model_name=served_model_name, max_model_len=max_model_len,
                        api_key=ns.api_key or os.environ.get("PHOTON_API_KEY") or None,
                        max_queued_requests=ns.max_queued_requests,
                        max_prompts_per_request=ns.max_prompts_per_request,
                        max_request_body_bytes=ns.max_request_body_bytes,
                        allowed_origins=tuple(ns.allowed_origins or ()),
                        enable_auto_tool_choice=ns.enable_auto_tool_choice,
                        tool_call_parser=ns.tool_call_parser,
                        chat_template=None if ns.chat_template is None
                        else resolve_chat_template(ns.chat_template))


def with_model_tag(ns: argparse.Namespace) -> argparse.Namespace:
    """The positional MODEL is the model; given with a different --model, which one is meant
    is unclear, so that is an error rather than one of them silently ignored."""
    if ns.model_tag is None:
        return ns
    if ns.model is not None and ns.model != ns.model_tag:
        raise ValueError(f"the model is given twice, as MODEL {ns.model_tag!r} and as --model "
                         f"{ns.model!r}; give it once")
    return argparse.Namespace(**{**vars(ns), "model": ns.model_tag})


def run_serve(ns: argparse.Namespace) -> int:
    """Serve until SIGTERM / Ctrl-C (then 0) or until the engine core dies (then 1, with one
    line on stderr naming the cause, so a supervisor restarts the server)."""
    from photon.cli import engine_args_from, print_model_notices
    from photon.engine.async_llm import AsyncLLM
    from photon.server.app import build_app

    config = engine_args_from(with_model_tag(ns)).create_config()
    model = config.model
    scfg = server_config(ns, model.served_model_name, model.max_model_len)
    print_model_notices(model)
    if ns.api_server_count < 1:
        raise ValueError("--api-server-count must be >= 1")
    if ns.api_server_count > 1:
        from photon.server.multi import serve_many

        if config.parallel.data_parallel_size > 1:
            raise ValueError("--api-server-count > 1 with --data-parallel-size > 1 is not "
                             "supported yet: use one of them")
        return serve_many(config, scfg, ns.host, ns.port, ns.api_server_count, ns.log_level)
    engine = AsyncLLM(config)  # the engine core runs in a process of its own
    try:
        app = build_app(engine, scfg)
    except BaseException:
        engine.shutdown()
        raise
    return serve_engine(app, engine, host=ns.host, port=ns.port, log_level=ns.log_level)


def serve_engine(app: Any, engine: Any, **uvicorn_args: Any) -> int:
    """Run uvicorn on `app` until SIGTERM / Ctrl-C (then 0) or until the engine core dies (then
    1, with one line on stderr naming the cause); the engine is shut down either way."""
    try:
        server = _server(app, engine, uvicorn_args)
        watchdog = threading.Thread(target=_exit_when_dead, args=(engine.dead, server),
                                    name="photon-watchdog", daemon=True)
        watchdog.start()
        server.run()
    finally:
        engine.shutdown()
    if engine.dead.is_set():
        print(f"photon serve: exiting: {engine.error}", file=sys.stderr)
        return 1
    return 0


def _server(app: Any, engine: Any, uvicorn_args: dict[str, Any]) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, minus its re-raise of the signal that stopped it: that would end the
        process before the engine core is shut down (photon exits with 0 instead). Shutting
        down, it first ends the open requests (a stream gets an error event, then [DONE]), so
        that no connection outlives the grace period and has its task cancelled."""

        async def shutdown(self, sockets: Any = None) -> None:
            engine.abort_all("the server is shutting down")
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            handlers = {sig: signal.signal(sig, self.handle_exit)
                        for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)

    return Server(uvicorn.Config(app, timeout_graceful_shutdown=5, **uvicorn_args))


def _exit_when_dead(dead: threading.Event, server: Any) -> None:
    """Stop the HTTP server once the engine core has died: its open streams have already
    ended with an error, and a supervisor should start a new server."""
    dead.wait()
    server.should_exit = True
