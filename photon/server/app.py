"""FastAPI app factory: `build_app(engine, config)`. No module globals: everything hangs off
`app.state` (`engine`: the AsyncEngine, `config`: ServerConfig, `metrics`: ServerMetrics,
`serving`: the request handling shared by the routes, with its admission count)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from photon import __version__
from photon.engine.async_engine import AsyncEngine, stopped_message
from photon.server.chat import ChatHandler
from photon.server.completions import CompletionHandler
from photon.server.errors import bad_request, error_response, install_handlers
from photon.server.lora import model_cards
from photon.server.metrics import RequestMetricsOnly, ServerMetrics
from photon.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from photon.server.openai_serving import ServerConfig, Serving
from photon.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)}
# A route whose 200 is text (the LoRA adapter endpoints, as vLLM's) still answers errors in JSON.
_JSON_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}} for code in _ERRORS}
_TEXT = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}
# With "stream": true the 200 body is Server-Sent Events: each event's `data` is one JSON chunk
# (or the final "[DONE]").
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
_STREAMING = {200: {"content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


def build_app(engine: AsyncEngine, config: ServerConfig, engine_metrics: bool = True) -> FastAPI:
    """The OpenAI-compatible app. Attaches its metrics to `engine` and starts the engine thread
    (idempotent). The caller owns the engine and shuts it down (`engine.shutdown()`): not the
    app's lifespan, which in-process ASGI clients may run once per request."""
    metrics = ServerMetrics(config.served_model_name)
    engine.observer = metrics if engine_metrics else RequestMetricsOnly(metrics)
    engine.start()
    app = FastAPI(title="photon", version=__version__)
    app.state.engine, app.state.config, app.state.metrics = engine, config, metrics
    install_handlers(app)
    _add_middleware(app, config)
    serving = app.state.serving = Serving(engine, config)
    _add_openai_routes(app, serving)
    _add_utility_routes(app, serving, metrics)
    app.openapi = _openapi_without_422(app)
    return app


def _add_middleware(app: FastAPI, config: ServerConfig) -> None:
    # add_middleware wraps: the last added is the outermost (CORS before auth, for preflights).
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])


def _add_openai_routes(app: FastAPI, serving: Serving) -> None:
    completions, chat = CompletionHandler(serving), ChatHandler(serving)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERRORS, **_STREAMING})
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await completions(req, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, **_STREAMING})
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat(req, raw)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models() -> dict[str, Any]:
        cfg = serving.config
        base = {"id": cfg.served_model_name, "root": cfg.served_model_name,
                "max_model_len": cfg.max_model_len,
                "vocab_size": serving.core.config.model.vocab_size}
        return {"object": "list",
                "data": model_cards(base, await serving.adapters.adapters())}

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
              responses={**_JSON_ERRORS, **_TEXT})
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> str:
        return await serving.adapters.load(req.lora_name, req.lora_path)

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
              responses={**_JSON_ERRORS, **_TEXT})
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> str:
        return await serving.adapters.unload(req.lora_name)


def _add_utility_routes(app: FastAPI, serving: Serving, metrics: ServerMetrics) -> None:
    async def health() -> Any:
        if not serving.engine.healthy:
            return error_response(503, stopped_message(serving.engine.error),
                                  code="engine_dead")
        return {"status": "ok"}

    # /ping is /health under SageMaker's name, for GET and POST (as vLLM).
    for path, method in (("/health", "GET"), ("/ping", "GET"), ("/ping", "POST")):
        app.add_api_route(path, health, methods=[method], response_model=HealthResponse,
                          responses={503: {"model": ErrorResponse}})

    @app.get("/version", response_model=VersionResponse)
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache", responses={409: {"model": ErrorResponse}})
    async def reset_prefix_cache() -> Any:
        """vLLM's: forget every cached prefix (a router's KV events then say AllBlocksCleared).
        Refused with 409 while requests hold KV blocks (their blocks would be cached again)."""
        done = await asyncio.to_thread(serving.engine.call_utility, "reset_prefix_cache")
        if not done:
            return error_response(409, "requests still hold KV blocks; reset the prefix cache "
                                       "when the server is idle", code="engine_busy")
        return {"status": "ok"}

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(req: TokenizeRequest) -> Any:
        # No length check: the count is what a client asks /tokenize for.
        await serving.resolve_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools or ()] or None
            text = await serving.chat_prompt(req, tools)
            ids = await serving.text.encode(text, add_special_tokens=False)
        else:
            ids = await serving.text.encode(req.prompt or "", req.add_special_tokens)
        return {"count": len(ids), "max_model_len": serving.config.max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest) -> Any:
        await serving.resolve_model(req.model)
        ids = serving.token_ids(req.tokens, "tokens")
        return {"prompt": await serving.text.decode(ids)}


def _openapi_without_422(app: FastAPI) -> Any:
    """Validation errors are answered with 400 (OpenAI's shape), so the schema says so."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi

