"""Token counts for `photon bench serve`: the server's /tokenize, or a local tokenizer.

Chat prompts of an exact length: a token-id prompt of N ids becomes a user message whose
templated prompt (what the server's `usage.prompt_tokens` counts) is exactly N tokens. The ids'
text is encoded once more into canonical tokens; a prefix of those is decoded into the message,
whose templated length is measured, and tokens are cut from its end or appended from the rest
until the count is N (a few rounds settle merges at the edges and characters split mid-way).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol

from photon.bench.serve_client import ClientConfig, make_session
from photon.bench.serve_workload import RequestSpec, ids_to_text

MAX_ROUNDS = 12  # encode/trim rounds per chat prompt before taking the closest length
_SIZING_CONCURRENCY = 16
REPLACEMENT_CHAR = "\ufffd"


class TextTokenizer(Protocol):
    """What the client needs of a tokenizer: the server's /tokenize, or a local one."""

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    async def decode(self, ids: Sequence[int]) -> str: ...

    async def chat_len(self, content: str) -> int:
        """Prompt tokens of one user message `content` after the chat template."""
        ...


class ServerTokenizer:
    """The served model's tokenizer through POST /tokenize and /detokenize (photon's, vLLM's)."""

    def __init__(self, session: Any, cfg: ClientConfig) -> None:
        self.session, self.cfg = session, cfg

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        url = self.cfg.base_url.rstrip("/") + path
        async with self.session.post(url, json={"model": self.cfg.model, **body},
                                     headers=self.cfg.headers()) as resp:
            if resp.status != 200:
                raise RuntimeError(f"POST {path}: HTTP {resp.status}: {(await resp.text())[:300]}")
            return await resp.json()

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = await self._post("/tokenize", {"prompt": text,
                                              "add_special_tokens": add_special_tokens})
        return list(body["tokens"])

    async def decode(self, ids: Sequence[int]) -> str:
        return str((await self._post("/detokenize", {"tokens": list(ids)}))["prompt"])

    async def chat_len(self, content: str) -> int:
        body = await self._post("/tokenize", {"messages": [{"role": "user", "content": content}],
                                              "add_generation_prompt": True})
        return int(body["count"])


class LocalTokenizer:
    """A model directory's tokenizer (and chat template), loaded in the client (--tokenizer)."""

    def __init__(self, model_dir: str) -> None:
        from photon.tokenizer import Tokenizer

        try:
            self.tok = Tokenizer.from_pretrained(model_dir)
        except (OSError, ValueError) as e:
            raise ValueError(f"--tokenizer {model_dir}: cannot load a tokenizer: {e}") from None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    async def chat_len(self, content: str) -> int:
        text = self.tok.apply_chat_template([{"role": "user", "content": content}],
                                            add_generation_prompt=True)
        return len(self.tok.encode(text, add_special_tokens=False))


@asynccontextmanager
async def open_tokenizer(cfg: ClientConfig, local_dir: str | None) -> AsyncIterator[TextTokenizer]:
    if local_dir:
        yield LocalTokenizer(local_dir)
        return
    async with make_session(cfg, _SIZING_CONCURRENCY) as session:
        yield ServerTokenizer(session, cfg)


async def _decode(tok: TextTokenizer, ids: Sequence[int]) -> str:
    # Ids that end inside a character decode to U+FFFD, which re-encodes as several tokens and
    # would never trim away; dropping it keeps each round's count moving.
    return (await tok.decode(ids)).replace(REPLACEMENT_CHAR, "")


@dataclass
class Sized:
    text: str
    tokens: int  # templated prompt tokens of `text`


async def fit_chat_prompt(tok: TextTokenizer, ids: Sequence[int], target: int,
                          overhead: int) -> Sized:
    """A user message from `ids` whose templated prompt is `target` tokens (or the closest
    length reached in MAX_ROUNDS rounds)."""
    # Tokens come from the canonical encoding of the ids' text: those re-encode as themselves,
    # so cutting or appending k of them moves the count by k except where they merge.
    source = await _decode(tok, ids) or ids_to_text(ids)
    filler = await tok.encode(source, add_special_tokens=False)
    content = filler[:target - overhead]
    best = current = await _measure(tok, content)
    for rounds in range(MAX_ROUNDS):
        if current.tokens == target:
            return current
        content = await tok.encode(current.text, add_special_tokens=False)
        gap = target - current.tokens
        # Too long: drop tokens from the end. Too short: append filler, starting one further on
        # each round so that a merge at the junction is not repeated.
        content = content[:len(content) + gap] if gap < 0 else \
            content + [filler[(len(content) + rounds + i) % len(filler)] for i in range(gap)]
        current = await _measure(tok, content)
        if abs(current.tokens - target) < abs(best.tokens - target):
            best = current
    return current if current.tokens == target else best


async def _measure(tok: TextTokenizer, content: Sequence[int]) -> Sized:
    text = await _decode(tok, content)
    return Sized(text, await tok.chat_len(text))


async def size_chat_prompts(tok: TextTokenizer, specs: Sequence[RequestSpec]) -> list[RequestSpec]:
    """Token-id prompts become texts of their length after the chat template; text prompts
    stay (the server's usage reports their length)."""
    overhead = await tok.chat_len("")
    shortest = min((len(s.prompt) for s in specs if isinstance(s.prompt, list)), default=None)
    if shortest is not None and shortest <= overhead:
        raise ValueError(f"chat prompts of {shortest} tokens are too short: the chat template "
                         f"alone is {overhead} tokens; ask for more (--random-input-len)")
    sem = asyncio.Semaphore(_SIZING_CONCURRENCY)

    async def one(spec: RequestSpec) -> RequestSpec:
        if not isinstance(spec.prompt, list):
            return replace(spec, prompt_len=None)
        async with sem:
            sized = await fit_chat_prompt(tok, spec.prompt, len(spec.prompt), overhead)
        return replace(spec, prompt=sized.text, prompt_len=sized.tokens)

    return list(await asyncio.gather(*(one(s) for s in specs)))
