"""`photon serve`: build the engine, the app and run uvicorn."""

from __future__ import annotations

import argparse
import os
from typing import Any

DEFAULT_MAX_BODY = 16 * 1024 * 1024


def add_serve(sub: Any) -> None:
    from photon.cli import add_engine_args

    p = sub.add_parser("serve", allow_abbrev=False, help="Run the OpenAI-compatible HTTP server.",
                       description="Serve the model over an OpenAI-compatible HTTP API.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="The model to serve, as vLLM's `vllm serve MODEL`: a local directory or a "
                        "Hugging Face hub id (the same as --model).")
    p.add_argument("--host", default="127.0.0.1",
                   help="Address to bind (default 127.0.0.1: local only).")
    p.add_argument("--port", type=int, default=8000, help="Port (default 8000; 0 = any free).")
    p.add_argument("--api-key", default=None,
                   help="Require `Authorization: Bearer KEY` (default: $PHOTON_API_KEY, if set).")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="How many sequences (prompts x n) may wait beyond the --max-num-seqs "
                        "that run at once; further requests get 429 with Retry-After "
                        "(default 1024).")
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
    import uvicorn

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

        return serve_many(config, scfg, ns.host, ns.port, ns.api_server_count, ns.log_level)
    engine = AsyncLLM(config)  # the engine core runs in a process of its own
    try:
        uvicorn.run(build_app(engine, scfg), host=ns.host, port=ns.port,
                    log_level=ns.log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0

