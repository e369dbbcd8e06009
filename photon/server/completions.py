"""POST /v1/completions: OpenAI's legacy completions, full or streamed (SSE).

`echo` prepends each prompt to its choices (with `logprobs`, the prompt tokens' logprobs come
first: None for the first token); `max_tokens=0` with `echo` returns only the prompt, as vLLM
does (one token is generated and dropped). vLLM's `prompt_logprobs` adds each prompt token's
logprob entry (`{token id: {logprob, rank, decoded_token}}`) to the choice.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from photon.engine.async_engine import EngineDeadError
from photon.outputs import CompletionOutput, PromptLogprobs, SampleLogprobs
from photon.server.errors import bad_request, error_body
from photon.server.openai_serving import Run, Serving
from photon.server.protocol import CompletionRequest, sse_event
from photon.server.responses import (
    ChoiceState,
    choice_updates,
    clamp_logprob,
    token_logprob,
    top_entries,
    usage,
    with_kv_transfer_params,
)


class CompletionHandler:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def __call__(self, req: CompletionRequest, raw: Request) -> Response:
        s = self.serving
        lora = await s.resolve_model(req.model)
        if req.suffix:
            raise bad_request("`suffix` is not supported by photon", "suffix")
        echo_only = req.echo and req.max_tokens == 0
        params = s.sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs,
                                   req.logprobs if req.echo else None)
        sources = _prompt_list(req.prompt)
        s.check_num_prompts(len(sources), params.n)
        prompts = [await s.encode(p, "prompt", req.add_special_tokens) if isinstance(p, str)
                   else s.token_ids(p, "prompt") for p in sources]
        for ids in prompts:
            s.check_prompt(ids, params, "prompt")
        echo = [_Echo(p if isinstance(p, str) else s.core.tokenizer.decode(ids), ids)
                for p, ids in zip(sources, prompts)] if req.echo else None
        run = await s.start(prompts, params, "cmpl", req.kv_transfer_params, lora)
        ctx = _Ctx(req, run, s, prompts, echo, echo_only)
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


@dataclass
class _Echo:
    text: str
    token_ids: list[int]


@dataclass
class _Part:
    """A piece of a choice's text with its tokens and their logprob entries (None: unknown,
    e.g. the first prompt token)."""

    text: str
    token_ids: list[int]
    entries: list[Any] | None


class _Ctx:
    def __init__(self, req: CompletionRequest, run: Run, serving: Serving,
                 prompts: list[list[int]], echo: list[_Echo] | None, echo_only: bool) -> None:
        self.req = req
        self.run = run
        self.id = run.id
        self.serving = serving
        self.created = int(time.time())
        self.model = run.model
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self.n = req.n
        self.echo = echo
        self.echo_only = echo_only
        # Per prompt: its prompt logprobs, once the engine delivered them.
        self.prompt_lps: dict[int, PromptLogprobs] = {}

    def _logprobs(self, parts: list[_Part], offset: int) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        text_of = self.serving.core.tokenizer.decode
        k = self.req.logprobs
        tokens, lps, tops, offsets = [], [], [], []
        for part in parts:
            for i, tid in enumerate(part.token_ids):
                entry = part.entries[i] if part.entries is not None else None
                text = text_of([tid], skip_special_tokens=False)
                tokens.append(text)
                offsets.append(offset)
                offset += len(text)
                if entry is None:
                    lps.append(None)
                    tops.append(None)
                    continue
                lps.append(clamp_logprob(token_logprob(entry, tid)))
                top = top_entries(entry, k) if k > 0 else [(tid, token_logprob(entry, tid))]
                tops.append({text_of([t], skip_special_tokens=False): clamp_logprob(v)
                             for t, v in top})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _parts(self, prompt: int, first: bool, token_ids: list[int],
               entries: SampleLogprobs | None, text: str) -> list[_Part]:
        """The choice's news: the echoed prompt first (in its first update), then the output
        (none with max_tokens=0)."""
        parts = []
        if first and self.echo is not None:
            echo = self.echo[prompt]
            parts.append(_Part(echo.text, echo.token_ids, self.prompt_lps.get(prompt)))
        if not self.echo_only:
            parts.append(_Part(text, token_ids, entries))
        return parts

    def _choice(self, idx: int, parts: list[_Part], offset: int, first: bool,
                c: CompletionOutput | ChoiceState) -> dict[str, Any]:
        choice = {"index": idx, "text": "".join(p.text for p in parts),
                  "logprobs": self._logprobs(parts, offset), "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if first and self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _prompt_logprobs_json(self.prompt_lps.get(idx // self.n))
        return choice

    def _response(self, choices: list[dict[str, Any]], final_usage: dict[str, int] | None
                  ) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": "text_completion",
                                "created": self.created, "model": self.model, "choices": choices}
        if final_usage is not None or not self.req.stream:
            body["usage"] = final_usage
        return with_kv_transfer_params(body, self.run)

    def _completion_tokens(self, count: int) -> int:
        return 0 if self.echo_only else count

    async def collect(self, run: Run) -> dict[str, Any]:
        states: dict[int, ChoiceState] = {}
        async for tag, out in run.outputs():
            if out.prompt_logprobs is not None:
                self.prompt_lps[tag] = out.prompt_logprobs
            for idx, c in choice_updates(tag, out, self.n):
                states.setdefault(idx, ChoiceState()).add(
                    c.token_ids, c.logprobs, c.text, c.finish_reason, c.stop_reason)
        choices = []
        for idx in range(len(run.request_ids) * self.n):
            st = states.get(idx, ChoiceState())
            parts = self._parts(idx // self.n, True, st.token_ids or [], st.logprobs, st.text)
            choices.append(self._choice(idx, parts, 0, True, st))
        completion = self._completion_tokens(sum(st.num_tokens for st in states.values()))
        return self._response(choices, usage(self.num_prompt_tokens, completion))

    async def events(self, run: Run) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}
        completion = 0
        try:
            async for tag, out in run.outputs():
                if out.prompt_logprobs is not None:
                    self.prompt_lps[tag] = out.prompt_logprobs
                for idx, c in choice_updates(tag, out, self.n):
                    completion += len(c.token_ids)
                    yield self._chunk(idx, c, offsets)
            opts = self.req.stream_options
            if opts is not None and opts.include_usage:
                final = usage(self.num_prompt_tokens, self._completion_tokens(completion))
                yield sse_event(self._response([], final))
        except EngineDeadError as e:
            yield sse_event(error_body(500, str(e), code="engine_dead"))
        yield sse_event("[DONE]")

    def _chunk(self, idx: int, c: CompletionOutput, offsets: dict[int, int]) -> str:
        # The first sample of a prompt scores it and is scheduled ahead of the others, so its
        # prompt logprobs come with (or before) any sample's first update.
        first = idx not in offsets
        parts = self._parts(idx // self.n, first, c.token_ids, c.logprobs, c.text)
        offset = offsets.get(idx, 0)
        offsets[idx] = offset + sum(len(p.text) for p in parts)
        return sse_event(self._response([self._choice(idx, parts, offset, first, c)], None))


def _prompt_logprobs_json(lps: PromptLogprobs | None) -> list[Any] | None:
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} (token ids as JSON keys)."""
    if lps is None:
        return None
    return [None if e is None else {
        str(t): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                 "decoded_token": lp.decoded_token} for t, lp in e.items()} for e in lps]
