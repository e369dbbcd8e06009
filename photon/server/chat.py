"""POST /v1/chat/completions: the model's chat template, full or streamed (SSE)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from photon.engine.async_engine import EngineDeadError
from photon.outputs import SampleLogprobs
from photon.reasoning import ReasoningSplitter
from photon.server.errors import bad_request, error_body
from photon.server.openai_serving import Run, Serving
from photon.server.protocol import ChatCompletionRequest, sse_event
from photon.server.responses import (
    ChoiceState,
    choice_updates,
    clamp_logprob,
    token_logprob,
    top_entries,
    usage,
    with_kv_transfer_params,
)
from photon.server.structured import precompile
from photon.server.tool_parsers import ToolCallStream, get_tool_parser
from photon.server.tools import ToolPlan, plan_tools


class ChatHandler:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        name = serving.config.tool_call_parser
        self.tool_parser = get_tool_parser(name) if name else None
        tok = serving.core.tokenizer
        self.eos_texts = tuple(tok.decode([i], skip_special_tokens=False)
                               for i in sorted(tok.eos_token_ids))

    async def __call__(self, req: ChatCompletionRequest, raw: Request) -> Response:
        s = self.serving
        lora = await s.resolve_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        tools = plan_tools(req, self.tool_parser, s.config.enable_auto_tool_choice,
                           self.eos_texts)
        if tools.keep_special_tokens:
            req.skip_special_tokens = False  # the parser's call marker is a special token
        params = s.sampling_params(req, max_tokens, logprobs)
        if tools.structured is not None:
            params.structured_outputs = tools.structured
            await precompile(s.core, tools.structured, "tools")
        s.check_num_prompts(1, params.n)
        text = await s.chat_prompt(req, tools.template_tools)
        ids = await s.encode(text, "messages", add_special_tokens=False)
        s.check_prompt(ids, params, "messages")
        run = await s.start([ids], params, "chatcmpl", req.kv_transfer_params, lora)
        ctx = _ChatCtx(req, run, s, len(ids), tools)
        return await s.respond(raw, run, req.stream, ctx.events, ctx.collect)


class _ChatCtx:
    def __init__(self, req: ChatCompletionRequest, run: Run, serving: Serving,
                 num_prompt_tokens: int, tools: ToolPlan) -> None:
        self.req = req
        self.tools = tools
        self.run = run
        self.id = run.id
        self.serving = serving
        self.created = int(time.time())
        self.model = run.model
        self.num_prompt_tokens = num_prompt_tokens
        self.reasoning = serving.core.reasoning  # --reasoning-parser, or None
        self.splitters: dict[int, ReasoningSplitter] = {}  # streaming: per choice

    def _token(self, tid: int, lp: float) -> dict[str, Any]:
        text = self.serving.core.tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": text, "logprob": clamp_logprob(lp), "bytes": list(text.encode())}

    def _logprobs(self, token_ids: list[int], entries: SampleLogprobs | None
                  ) -> dict[str, Any] | None:
        if entries is None or not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0
        content = []
        for tid, entry in zip(token_ids, entries):
            item = self._token(tid, token_logprob(entry, tid))
            item["top_logprobs"] = [self._token(t, v) for t, v in top_entries(entry, k)]
            content.append(item)
        return {"content": content}

    def _body(self, obj: str, choices: list[dict[str, Any]],
              final_usage: dict[str, int] | None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created,
                                "model": self.model, "choices": choices}
        if final_usage is not None or not self.req.stream:
            body["usage"] = final_usage
        return with_kv_transfer_params(body, self.run)

    async def collect(self, run: Run) -> dict[str, Any]:
        states: dict[int, ChoiceState] = {}
        async for tag, out in run.outputs():
            for idx, c in choice_updates(tag, out, self.req.n):
                states.setdefault(idx, ChoiceState()).add(
                    c.token_ids, c.logprobs, c.text, c.finish_reason, c.stop_reason)
        choices = []
        for idx in range(self.req.n):
            st = states.get(idx, ChoiceState())
            message, finish = self._message(st.text, st.finish_reason)
            choices.append({"index": idx, "message": message,
                            "logprobs": self._logprobs(st.token_ids or [], st.logprobs),
                            "finish_reason": finish, "stop_reason": st.stop_reason})
        completion = sum(st.num_tokens for st in states.values())
        return self._body("chat.completion", choices, usage(self.num_prompt_tokens, completion))

    def _message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message and finish_reason of a finished choice. With a reasoning parser
        the think block goes to `reasoning_content` (and vLLM's newer `reasoning`); tool calls
        are read from the rest, the content, as vLLM does."""
        if self.reasoning is None:
            return self.tools.reply(text, finish)
        split = self.reasoning.split(text)
        message, finish = self.tools.reply(split.content, finish)
        if split.reasoning is not None:
            message["content"] = message["content"] or None
            message["reasoning_content"] = message["reasoning"] = split.reasoning
        return message, finish

    def _chunk(self, idx: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
               finish: str | None = None, stop_reason: int | str | None = None) -> str:
        choice = {"index": idx, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": stop_reason}
        return sse_event(self._body("chat.completion.chunk", [choice], None))

    def _delta(self, idx: int, stream: ToolCallStream | None, text: str, finish: str | None
               ) -> tuple[dict[str, Any], str | None]:
        """A choice's delta message for its new text, and the chunk's finish_reason: the same
        split as `_message`, piece by piece (reasoning first, then tool calls in the content)."""
        delta: dict[str, Any] = {}
        if self.reasoning is not None:
            splitter = self.splitters.setdefault(idx, self.reasoning.splitter())
            piece = splitter.feed(text, finish is not None)
            if piece.reasoning:
                delta["reasoning_content"] = delta["reasoning"] = piece.reasoning
            text = piece.content
        if stream is None:
            if text:
                delta["content"] = text
            return delta, finish
        news = stream.feed(self.tools.output_text(text, finish), final=finish is not None)
        if news.content:
            delta["content"] = news.content
        if news.tool_calls:
            delta["tool_calls"] = news.tool_calls
        return delta, self.tools.finish_reason(finish, stream.called)

    async def events(self, run: Run) -> AsyncIterator[str]:
        completion = 0
        streams = [self.tools.stream() for _ in range(self.req.n)]
        try:
            for idx in range(self.req.n):
                yield self._chunk(idx, {"role": "assistant", "content": ""})
            async for tag, out in run.outputs():
                for idx, c in choice_updates(tag, out, self.req.n):
                    completion += len(c.token_ids)
                    delta, finish = self._delta(idx, streams[idx], c.text, c.finish_reason)
                    yield self._chunk(idx, delta, self._logprobs(c.token_ids, c.logprobs),
                                      finish, c.stop_reason)
            opts = self.req.stream_options
            if opts is not None and opts.include_usage:
                body = self._body("chat.completion.chunk", [],
                                  usage(self.num_prompt_tokens, completion))
                yield sse_event(body)
        except EngineDeadError as e:
            yield sse_event(error_body(500, str(e), code="engine_dead"))
        yield sse_event("[DONE]")
