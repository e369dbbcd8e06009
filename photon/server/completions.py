"""POST /v1/completions: OpenAI's legacy completions, full or streamed (SSE)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from photon.engine.async_engine import EngineDeadError
from photon.server.errors import bad_request, error_body
from photon.server.openai_serving import (
    ChoiceState,
    Run,
    Serving,
    choice_updates,
    clamp_logprob,
    top_entries,
    usage,
)
from photon.server.protocol import CompletionRequest, sse_event


class CompletionHandler:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def __call__(self, req: CompletionRequest, raw: Request) -> Response:
        s = self.serving
        s.check_model(req.model)
        if req.echo:
            raise bad_request("echo is not supported", "echo")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        sources = _prompt_list(req.prompt)
        params = s.sampling_params(req, req.max_tokens, req.logprobs)
        s.check_num_prompts(len(sources), params.n)
        prompts = [await s.encode(p, "prompt") if isinstance(p, str) else s.token_ids(p, "prompt")
                   for p in sources]
        for ids in prompts:
            s.check_prompt(ids, params, "prompt")
        run = await s.start(prompts, params, "cmpl")
        ctx = _Ctx(req, run.id, s, sum(len(p) for p in prompts))
        return await s.respond(raw, run, req.stream, ctx.events, ctx.collect)


def _prompt_list(prompt: str | list[Any]) -> list[str | list[int]]:
    """The request's prompts (the protocol model has checked the shape)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("the prompt is empty; give at least one token", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt)


class _Ctx:
    def __init__(self, req: CompletionRequest, rid: str, serving: Serving,
                 num_prompt_tokens: int) -> None:
        self.req = req
        self.id = rid
        self.serving = serving
        self.created = int(time.time())
        self.model = serving.config.served_model_name
        self.num_prompt_tokens = num_prompt_tokens
        self.n = req.n

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None,
                  offset: int) -> dict[str, Any] | None:
        if entries is None or self.req.logprobs is None:
            return None
        decode = self.serving.core.tokenizer.decode
        k = self.req.logprobs
        tokens, lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            text = decode([tid], skip_special_tokens=False)
            tokens.append(text)
            lps.append(clamp_logprob(entry.get(tid, _MISSING)))
            top = top_entries(entry, k) if k > 0 else [(tid, entry.get(tid, _MISSING))]
            tops.append({decode([t], skip_special_tokens=False): clamp_logprob(v)
                         for t, v in top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _response(self, choices: list[dict[str, Any]], final_usage: dict[str, int] | None
                  ) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": "text_completion",
                                "created": self.created, "model": self.model, "choices": choices}
        if final_usage is not None or not self.req.stream:
            body["usage"] = final_usage
        return body

    async def collect(self, run: Run) -> dict[str, Any]:
        states: dict[int, ChoiceState] = {}
        async for tag, out in run.outputs():
            for idx, c in choice_updates(tag, out, self.n):
                states.setdefault(idx, ChoiceState()).add(
                    c.token_ids, c.logprobs, c.text, c.finish_reason, c.stop_reason)
        choices = []
        for idx in range(len(run.request_ids) * self.n):
            st = states.get(idx, ChoiceState())
            choices.append({"index": idx, "text": st.text,
                            "logprobs": self._logprobs(st.token_ids or [], st.logprobs, 0),
                            "finish_reason": st.finish_reason, "stop_reason": st.stop_reason})
        completion = sum(st.num_tokens for st in states.values())
        return self._response(choices, usage(self.num_prompt_tokens, completion))

    async def events(self, run: Run) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}
        completion = 0
        try:
            async for tag, out in run.outputs():
                for idx, c in choice_updates(tag, out, self.n):
                    completion += len(c.token_ids)
                    lp = self._logprobs(c.token_ids, c.logprobs, offsets.get(idx, 0))
                    offsets[idx] = offsets.get(idx, 0) + len(c.text)
                    yield sse_event(self._response([{
                        "index": idx, "text": c.text, "logprobs": lp,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}], None))
            opts = self.req.stream_options
            if opts is not None and opts.include_usage:
                yield sse_event(self._response([], usage(self.num_prompt_tokens, completion)))
        except EngineDeadError as e:
            yield sse_event(error_body(500, str(e), code="engine_dead"))
        yield sse_event("[DONE]")


_MISSING = float("-inf")
