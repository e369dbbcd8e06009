"""The HTTP side of `photon bench serve`: streaming OpenAI requests on an aiohttp session.

Each request streams (`stream: true`, usage included) with `ignore_eos` and `max_tokens` set to
its output length; chunk arrival times give TTFT and ITL, the final usage chunk the token counts.
Requests start at their arrival offsets; an optional semaphore caps how many are in flight (a
request's clock starts when it is sent, after the semaphore).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from photon.bench.serve_metrics import RequestRecord
from photon.bench.serve_workload import RequestSpec, ids_to_text

CHAT_ENDPOINT = "/v1/chat/completions"
_DONE = object()


@dataclass
class ClientConfig:
    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    temperature: float = 0.0
    timeout_s: float = 6 * 3600.0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("/chat/completions")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_payload(cfg: ClientConfig, spec: RequestSpec) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": cfg.model, "max_tokens": spec.output_len, "temperature": cfg.temperature,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    if cfg.chat:
        text = spec.prompt if isinstance(spec.prompt, str) else ids_to_text(spec.prompt)
        payload["messages"] = spec.messages or [{"role": "user", "content": text}]
        payload["max_completion_tokens"] = spec.output_len
    else:
        payload["prompt"] = spec.prompt
    return payload


def parse_sse_line(raw: bytes | str) -> Any:
    """The JSON of a `data:` line, `_DONE` for `data: [DONE]`, None for anything else."""
    line = (raw.decode("utf-8") if isinstance(raw, bytes) else raw).strip()
    if not line.startswith("data:"):
        return None  # blank separators, `: comments`, `event:` lines
    data = line[len("data:"):].strip()
    return _DONE if data == "[DONE]" else json.loads(data)


def chunk_text(data: dict[str, Any], chat: bool) -> str | None:
    """The text a chunk carries (completions `text`, chat `delta.content`), if any."""
    choices = data.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        if "role" in delta and not delta.get("content"):
            return None  # the role announcement a server may send before any token
        return delta.get("content")
    return choice.get("text")


class _Stream:
    """Folds one response stream's chunks into a record."""

    def __init__(self, record: RequestRecord, chat: bool, sent: float) -> None:
        self.record, self.chat, self.sent, self.last = record, chat, sent, sent
        self.chunks = 0
        self.usage_seen = False

    def feed(self, data: dict[str, Any], now: float) -> None:
        if data.get("error"):
            raise RuntimeError(f"error in stream: {json.dumps(data['error'])[:500]}")
        usage = data.get("usage")
        if usage:
            self.usage_seen = True
            self.record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.record.output_tokens = int(usage.get("completion_tokens") or 0)
        # A chunk that carries a choice's text counts as a token arrival even when that text is
        # empty: with a tokenizer that cannot spell every id (random-weight shapes served with
        # photon-tiny's tokenizer), requiring non-empty text would push TTFT to the end.
        text = chunk_text(data, self.chat)
        if text is not None:
            self.record.text += text
            if self.record.ttft is None:
                self.record.ttft = now - self.sent
            else:
                self.record.itl.append(now - self.last)
            self.last = now
            self.chunks += 1

    def finish(self, prompt_len: int | None) -> None:
        if not self.usage_seen:  # no usage: a chunk per token, the prompt length as sent
            self.record.output_tokens = self.chunks
            self.record.prompt_tokens = prompt_len or 0
        self.record.success = True


async def send_request(session: Any, cfg: ClientConfig, spec: RequestSpec,
                       t0: float) -> RequestRecord:
    """One streamed request; failures (HTTP status, stream errors, exceptions) are recorded."""
    record = RequestRecord(success=False, output_len=spec.output_len)
    sent = time.perf_counter()
    record.start = sent - t0
    stream = _Stream(record, cfg.chat, sent)
    try:
        async with session.post(cfg.url, json=build_payload(cfg, spec),
                                headers=cfg.headers()) as resp:
            if resp.status != 200:
                body = (await resp.text())[:500]
                raise RuntimeError(f"HTTP {resp.status}: {body}")
            async for raw in resp.content:
                data = parse_sse_line(raw)
                if data is _DONE:
                    break
                if data is not None:
                    stream.feed(data, time.perf_counter())
        stream.finish(spec.prompt_len)
    except Exception as exc:  # every failure is a failed request, not a crash
        record.success = False
        record.error = str(exc) or type(exc).__name__
    record.latency = time.perf_counter() - sent
    return record


def make_session(cfg: ClientConfig, max_connections: int) -> Any:
    from photon.bench.cli import require

    aiohttp = require("aiohttp", "photon bench serve")
    connector = aiohttp.TCPConnector(limit=max(1, max_connections), ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def _scheduled(session: Any, cfg: ClientConfig, spec: RequestSpec, at: float,
                     t0: float, sem: asyncio.Semaphore | None) -> RequestRecord:
    delay = t0 + at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    if sem is None:
        return await send_request(session, cfg, spec, t0)
    async with sem:
        return await send_request(session, cfg, spec, t0)


async def run_requests(cfg: ClientConfig, specs: Sequence[RequestSpec], offsets: Sequence[float],
                       max_concurrency: int | None) -> tuple[list[RequestRecord], float]:
    """All requests at their offsets (s); returns the records and the run's wall time (s)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with make_session(cfg, max_concurrency or len(specs)) as session:
        t0 = time.perf_counter()
        tasks = [_scheduled(session, cfg, s, at, t0, sem) for s, at in zip(specs, offsets)]
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - t0


async def get_json(cfg: ClientConfig, path: str) -> Any:
    async with make_session(cfg, 1) as session:
        async with session.get(cfg.base_url.rstrip("/") + path, headers=cfg.headers()) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {resp.status}: {(await resp.text())[:300]}")
            return await resp.json()


@dataclass
class ServedModel:
    """A model card of GET /v1/models: what the client sizes its requests by."""

    id: str
    max_model_len: int | None = None  # vLLM and photon report it
    vocab_size: int | None = None  # photon reports it; token-id prompts must stay below it

    @classmethod
    def from_card(cls, card: dict[str, Any]) -> ServedModel:
        def positive(key: str) -> int | None:
            value = card.get(key)
            return value if isinstance(value, int) and value > 0 else None

        return cls(str(card["id"]), positive("max_model_len"), positive("vocab_size"))


async def wait_for_models(cfg: ClientConfig, wait_s: float) -> list[ServedModel]:
    """The model cards of GET /v1/models, retried for up to `wait_s` seconds while it fails."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            body = await get_json(cfg, "/v1/models")
            return [ServedModel.from_card(m) for m in body.get("data", [])]
        except Exception:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.5)
