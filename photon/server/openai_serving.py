"""Request handling shared by /v1/completions and /v1/chat/completions.

Every prompt of an HTTP request becomes one engine request (with the request's `n`); all of them
deliver into one `RequestSink`. Leaving a handler for any reason (done, error, client gone) aborts
whatever is unfinished, so a disconnected client's KV blocks are freed within one engine step.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from photon.engine.async_engine import AsyncEngine, RequestSink
from photon.errors import AdapterNotFoundError
from photon.lora.request import LoRARequest
from photon.outputs import RequestOutput
from photon.sampling_params import SamplingParams
from photon.server.admission import Admission, Ticket
from photon.server.defaults import unset_defaults
from photon.server.errors import APIError, bad_request, invalid_value
from photon.server.lora import AdapterNames, model_not_found
from photon.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    TokenizeRequest,
    _SamplingFields,
)
from photon.server.structured import precompile, structured_params
from photon.server.tokenization import PromptTokenizer
from photon.server.tools import template_messages

T = TypeVar("T")
# Chat-template variables set from request fields, not from chat_template_kwargs.
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "chat_template",
                                     "continue_final_message", "tools"})


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    max_model_len: int
    api_key: str | None = None
    max_queued_requests: int = 1024  # sequences (prompts x n) waiting beyond max_num_seqs
    max_prompts_per_request: int = 256
    max_request_body_bytes: int = 16 * 1024 * 1024
    allowed_origins: tuple[str, ...] = ()
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None  # a name in photon.server.tool_parsers
    chat_template: str | None = None  # --chat-template (its text); None: the model's own
    # The admission count every API server of a deployment shares (`SharedCount`'s file);
    # None: one server, its own count.
    shared_admission: str | None = None


class Run:
    """The engine requests of one HTTP request; `outputs()` yields (prompt index, output).
    Holds the request's admission ticket: each prompt's n sequences are released when it
    finishes, and whatever is left when the run is aborted or fails."""

    def __init__(self, engine: AsyncEngine, sink: RequestSink, run_id: str,
                 request_ids: list[str], ticket: Ticket, n: int, model: str) -> None:
        self.id = run_id  # the response's id
        self.model = model  # the response's model: the served model's name, or the adapter's
        self.engine = engine
        self.sink = sink
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self.ticket = ticket
        self.n = n
        # What the engine's KV connector returned for the decode side (prefill/decode
        # disaggregation); set once an output carries it.
        self.kv_transfer_params: dict[str, Any] | None = None

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self.unfinished:
            tag, item = await self.sink.get()
            if isinstance(item, BaseException):
                self.unfinished.clear()
                self.ticket.release_all()
                raise item
            if item.finished and item.request_id in self.unfinished:
                self.unfinished.discard(item.request_id)
                self.ticket.release(self.n)
            params = getattr(item, "kv_transfer_params", None)
            if params is not None:
                self.kv_transfer_params = params
            yield tag, item

    def abort_unfinished(self) -> None:
        for rid in self.unfinished:
            self.engine.abort(rid)
        self.unfinished.clear()
        self.ticket.release_all()


class AbortingStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the response ends (even if cancelled
    before the body iterator started)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Serving:
    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.core = engine.frontend  # read-only: config, tokenizer, edge checks, grammar compiles
        self.config = config
        self.admission = Admission(self.core.config.scheduler.max_num_seqs,
                                   config.max_queued_requests, config.shared_admission)
        self.text = PromptTokenizer(self.core.tokenizer, config.max_model_len)
        self.kv_transfer = "kv_transfer_params" in inspect.signature(engine.add_request).parameters
        self.adapters = AdapterNames(engine, config.served_model_name,
                                     self.core.config.lora_config is not None)

    # ---- checks -------------------------------------------------------------------------------
    async def resolve_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter the request's `model` names (None: the base model); 404 for a
        name that is neither."""
        return await self.adapters.resolve(name)

    def check_num_prompts(self, num_prompts: int, n: int) -> None:
        limit = self.config.max_prompts_per_request
        if num_prompts > limit:
            raise bad_request(f"the request has {num_prompts} prompts; this server accepts at "
                              f"most {limit} per request", "prompt")
        self.admission.check_size(num_prompts, n)

    def sampling_params(self, req: _SamplingFields, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        """`prompt_logprobs`: asked for by the endpoint (completions' echo) when the request's
        own field (completions only) is not set."""
        check_fields(req)
        structured = structured_params(req)
        own = getattr(req, "prompt_logprobs", None)
        prompt_logprobs = own if own is not None else prompt_logprobs
        given = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                              "presence_penalty", "frequency_penalty",
                                              "repetition_penalty") if getattr(req, k) is not None}
        defaults = unset_defaults(req, self.core.config.model.generation_defaults)
        max_tokens = defaults.pop("max_tokens", max_tokens)
        given = {**defaults, **given}
        try:
            params = SamplingParams(
                n=req.n, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=logit_bias(req.logit_bias),
                structured_outputs=structured, **given)
            params.validate_token_ids(self.core.config.model.vocab_size)
        except ValueError as e:
            raise invalid_value(e, type(req).model_fields) from None
        return params

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids; a text too long to fit is refused before tokenizing."""
        self.text.check_length(text, param)
        return await self.text.encode(text, add_special_tokens)

    def token_ids(self, ids: list[int], param: str) -> list[int]:
        try:
            return self.core.tokenize_prompt(ids)[1]
        except ValueError as e:
            raise invalid_value(e, default=param) from None

    def check_prompt(self, ids: list[int], params: SamplingParams, param: str) -> None:
        max_len = self.config.max_model_len
        if not ids:
            raise bad_request("the prompt is empty; give at least one token", param)
        if len(ids) >= max_len:
            raise bad_request(f"the prompt is {len(ids)} tokens long, but this model's maximum "
                              f"context length is {max_len} tokens", param)
        defaults = self.core.config.model.generation_defaults
        if defaults is not None and params.max_tokens == defaults.max_tokens:
            # The model's max_new_tokens is a cap, as in vLLM: the engine shortens it to what
            # the context leaves (a request's max_tokens equal to it is taken the same way);
            # any other max_tokens a request gives must fit.
            return
        try:
            self.core.check_fits(len(ids), params.max_tokens)
        except ValueError as e:
            raise bad_request(str(e), "max_tokens") from None

    async def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest,
                          tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template's text for `req.messages` (and `tools`), rendered in a worker thread
        (it may be long), with the request's chat controls."""
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be "
                              "true; set add_generation_prompt to false to continue the final "
                              "message", "continue_final_message")
        return await asyncio.to_thread(self._render_chat, req, tools)

    def _render_chat(self, req: ChatCompletionRequest | TokenizeRequest,
                     tools: list[dict[str, Any]] | None) -> str:
        msgs = template_messages([{**m.model_dump(exclude_none=True, exclude={"content"}),
                                   "content": _message_text(m)} for m in req.messages or []])
        kwargs = req.chat_template_kwargs or {}
        reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_VARS)
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}; use the "
                              f"request fields of those names", "chat_template_kwargs")
        try:
            return self.core.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=req.add_generation_prompt,
                chat_template=self.config.chat_template,
                continue_final_message=req.continue_final_message, tools=tools, **kwargs)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise bad_request(f"could not apply the chat template: {e}", "messages") from None

    def check_kv_transfer(self, kv_transfer_params: dict[str, Any] | None, num_prompts: int,
                          n: int) -> None:
        """kv_transfer_params moves one sequence's KV cache: one prompt, n=1, and an engine
        that takes them."""
        if kv_transfer_params is None:
            return
        if not self.kv_transfer:
            raise bad_request("`kv_transfer_params` is not supported by this engine",
                              "kv_transfer_params")
        if num_prompts != 1 or n != 1:
            raise bad_request(f"kv_transfer_params applies to one prompt with n=1 (got "
                              f"{num_prompts} prompts, n={n})", "kv_transfer_params")
        if self.core.config.kv_transfer_config is not None:  # e.g. a remote_host not allowed
            try:
                self.core.checks.kv_transfer_params(kv_transfer_params, n)
            except ValueError as e:
                raise invalid_value(e, default="kv_transfer_params") from None

    # ---- running ------------------------------------------------------------------------------
    async def start(self, prompts: list[list[int]], params: SamplingParams, prefix: str,
                    kv_transfer_params: dict[str, Any] | None = None,
                    lora_request: LoRARequest | None = None) -> Run:
        self.check_kv_transfer(kv_transfer_params, len(prompts), params.n)
        # No await before admit(): concurrent requests are counted in the order they get here.
        ticket = self.admission.admit(len(prompts) * params.n)
        try:
            await precompile(self.core, params.structured_outputs)
            model = self.config.served_model_name if lora_request is None \
                else lora_request.lora_name
            return await self._add(prompts, params, f"{prefix}-{uuid.uuid4().hex}", model,
                                   ticket, _extra(kv_transfer_params, lora_request))
        except BaseException:
            ticket.release_all()
            raise

    async def _add(self, prompts: list[list[int]], params: SamplingParams, base: str,
                   model: str, ticket: Ticket, extra: dict[str, Any]) -> Run:
        sink = RequestSink()
        ids = [base if len(prompts) == 1 else f"{base}-{i}" for i in range(len(prompts))]
        run = Run(self.engine, sink, base, ids, ticket, params.n, model)
        now = time.monotonic()
        results = await asyncio.gather(*(
            self.engine.add_request(p, params, rid, sink, tag=i, arrival_time=now, **extra)
            for i, (p, rid) in enumerate(zip(prompts, ids))), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            run.abort_unfinished()
            if isinstance(errors[0], AdapterNotFoundError):  # unloaded since the model resolved
                raise model_not_found(model) from None
            if isinstance(errors[0], ValueError):
                raise invalid_value(errors[0], default="prompt") from None
            raise errors[0]
        return run

    async def respond(self, raw: Request, run: Run, stream: bool,
                      events: Callable[[Run], AsyncIterator[str]],
                      collect: Callable[[Run], Awaitable[dict[str, Any]]]) -> Response:
        if stream:
            return AbortingStream(events(run), run.abort_unfinished)
        return await _unless_disconnected(raw, run, collect(run))


def _extra(kv_transfer_params: dict[str, Any] | None, lora_request: LoRARequest | None
           ) -> dict[str, Any]:
    """add_request's optional arguments, only those given: an engine without a KV connector
    need not take kv_transfer_params."""
    extra: dict[str, Any] = {}
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    if lora_request is not None:
        extra["lora_request"] = lora_request
    return extra


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # an unexpected extra body message: do not spin


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client went away first (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()


async def _unless_disconnected(raw: Request, run: Run,
                               work: Awaitable[dict[str, Any]]) -> Response:
    """Await the full response, aborting the engine requests if the client goes away."""
    try:
        body = await unless_disconnected(raw, work)
        return Response(status_code=499) if body is None else JSONResponse(body)  # 499: gone
    finally:
        run.abort_unfinished()


def _message_text(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"unsupported content part type {part.type!r}; only text is "
                              f"supported", "messages")
        parts.append(part.text)
    return "\n".join(parts)


def check_fields(req: _SamplingFields) -> None:
    """400 for a known field photon does not implement (see protocol.UNSUPPORTED)."""
    for name in req.unsupported_fields():
        raise bad_request(f"`{name}` is not supported by photon", name)
    if req.best_of is not None and req.best_of != 1:
        raise bad_request(f"`best_of` is not supported by photon (only 1, got {req.best_of}); "
                          f"use `n` for several completions and `logprobs` to rank them",
                          "best_of")


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys) with integer ids; ranges are checked
    by SamplingParams."""
    if bias is None:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key.strip()
        if not token.isdigit():  # str.isdigit also takes non-ASCII digits: int() reads them
            raise bad_request(f"logit_bias keys must be token ids (non-negative integers), "
                              f"got {key!r}", "logit_bias")
        out[int(token)] = value
    return out
