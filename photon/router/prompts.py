"""A request's prompt as token ids, the way the backend will see them, for prefix routing.

`PromptTokenizer.token_ids(path, body)` returns the prompt's ids, or None when they cannot be
had (then the request is routed by load alone; the backend reports any real error itself).
- LocalTokenizer (`--tokenizer DIR`): the served model's tokenizer.json and chat template, in a
  worker thread: completions encode the text with special tokens (as the server does), chat
  renders the template with the request's chat controls and encodes without them.
- BackendTokenizer (no --tokenizer): asks a healthy backend's `/tokenize`, which photon serves
  with exactly its own rules (one extra round trip per request, under a short timeout).
A completions request with several prompts is routed by its first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

log = logging.getLogger("photon.router")

_CHAT_CONTROLS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                  "tools")


@dataclass(frozen=True)
class PromptSpec:
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    controls: dict[str, Any] = field(default_factory=dict)  # chat controls, add_special_tokens


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in value)


def prompt_spec(path: str, body: dict[str, Any]) -> PromptSpec | None:
    """What to tokenize for `body` (None: nothing usable, e.g. a malformed prompt)."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        controls = {k: body[k] for k in _CHAT_CONTROLS if body.get(k) is not None}
        return PromptSpec(messages=messages, controls=controls)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not _is_ids(prompt):
        prompt = prompt[0]  # a batch: its first prompt
    special = {"add_special_tokens": body.get("add_special_tokens", True) is not False}
    if isinstance(prompt, str):
        return PromptSpec(text=prompt, controls=special)
    if _is_ids(prompt) and prompt:
        return PromptSpec(token_ids=list(prompt))
    return None


class PromptTokenizer(Protocol):
    async def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None: ...


def _message_text(content: Any) -> str:
    if isinstance(content, list):  # content parts: their text, as the server joins them
        return "\n".join(p.get("text") or "" for p in content
                         if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


class LocalTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # photon.tokenizer.Tokenizer

    async def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        spec = prompt_spec(path, body)
        if spec is None or spec.token_ids is not None:
            return None if spec is None else spec.token_ids
        try:
            return await asyncio.to_thread(self._encode, spec)
        except Exception as e:  # noqa: BLE001 - the backend will answer the request's error
            log.debug("could not tokenize a prompt for routing: %s", e)
            return None

    def _encode(self, spec: PromptSpec) -> list[int]:
        if spec.messages is None:
            return self.tokenizer.encode(spec.text or "", spec.controls["add_special_tokens"])
        msgs = [{**m, "content": _message_text(m.get("content"))} for m in spec.messages
                if isinstance(m, dict)]
        c = spec.controls
        text = self.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=c.get("add_generation_prompt", True),
            continue_final_message=c.get("continue_final_message", False),
            tools=c.get("tools"), **(c.get("chat_template_kwargs") or {}))
        return self.tokenizer.encode(text, add_special_tokens=False)


class BackendTokenizer:
    def __init__(self, client: httpx.AsyncClient, pick: Callable[[], str | None],
                 timeout_s: float) -> None:
        self.client = client
        self.pick = pick  # a healthy backend's URL, or None
        self.timeout_s = timeout_s

    async def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        spec = prompt_spec(path, body)
        if spec is None or spec.token_ids is not None:
            return None if spec is None else spec.token_ids
        url = self.pick()
        if url is None:
            return None
        request: dict[str, Any] = {"model": body.get("model"), **spec.controls}
        request.update({"messages": spec.messages} if spec.messages is not None
                       else {"prompt": spec.text})
        try:
            resp = await self.client.post(f"{url}/tokenize", json=request, timeout=self.timeout_s)
            tokens = resp.json().get("tokens") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as e:
            log.debug("%s/tokenize failed: %s", url, e)
            return None
        return tokens if _is_ids(tokens) else None
