"""Back-pressure: a request's outputs that its consumer has not taken yet are merged into one,
so a slow client gets several steps' tokens per event and what waits for it is bounded by its
output, not by the number of steps."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from photon.engine.request_sink import RequestSink, merge_outputs
from photon.outputs import CompletionOutput, Logprob, RequestOutput
from tests.server_util import live_server, wait_drained


def _out(rid: str, children: list[CompletionOutput], finished: bool = False,
         **kw: object) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2], children, finished, **kw)


def _lp(tid: int, value: float) -> dict[int, Logprob]:
    return {tid: Logprob(value, 1)}


def test_merge_outputs_values() -> None:
    a = _out("r", [CompletionOutput(0, "he", [5], -0.5, [_lp(5, -0.5)]),
                   CompletionOutput(1, "x", [9], -1.0, [_lp(9, -1.0)])],
             prompt_logprobs=[None, _lp(2, -3.0)], num_cached_tokens=0)
    b = _out("r", [CompletionOutput(0, "llo", [6, 7], -1.5, [_lp(6, -0.25), _lp(7, -0.75)])])
    c = _out("r", [CompletionOutput(1, "y", [8], -2.0, [_lp(8, -1.0)], "length"),
                   CompletionOutput(0, "!", [3], -1.75, [_lp(3, -0.25)], "stop", "!")],
             finished=True, num_cached_tokens=4)
    m = merge_outputs(merge_outputs(a, b), c)
    assert m.finished and m.request_id == "r" and m.prompt_token_ids == [1, 2]
    assert m.prompt_logprobs == [None, _lp(2, -3.0)] and m.num_cached_tokens == 0
    first, second = m.outputs  # in the order the sequences first appeared
    assert (first.index, first.text, first.token_ids) == (0, "hello!", [5, 6, 7, 3])
    assert first.logprobs == [_lp(5, -0.5), _lp(6, -0.25), _lp(7, -0.75), _lp(3, -0.25)]
    assert (first.cumulative_logprob, first.finish_reason, first.stop_reason) == \
        (-1.75, "stop", "!")
    assert (second.text, second.token_ids, second.finish_reason) == ("xy", [9, 8], "length")
    assert second.logprobs == [_lp(9, -1.0), _lp(8, -1.0)] and second.cumulative_logprob == -2.0
    assert a.outputs[0].text == "he" and a.outputs[0].token_ids == [5]  # inputs left as they were


def test_merge_keeps_a_finish_given_earlier() -> None:
    """A child stopped by a stop string in the front end gets one more, empty output without a
    finish (the core's tokens before its abort landed); merged, the child keeps its finish."""
    a = _out("r", [CompletionOutput(0, "ok", [5], None, None, "stop", "\n"),
                   CompletionOutput(1, "a", [6])])
    b = _out("r", [CompletionOutput(0, "", []), CompletionOutput(1, "b", [7], None, None,
                                                                 "length")], finished=True)
    first, second = merge_outputs(a, b).outputs
    assert (first.text, first.finish_reason, first.stop_reason) == ("ok", "stop", "\n")
    assert (second.text, second.finish_reason) == ("ab", "length")


def test_sink_merges_what_the_consumer_has_not_taken() -> None:
    """Outputs of one request put while nobody reads come out as one item; other requests'
    items and exceptions keep their order and are never merged into another."""

    async def run() -> list[tuple[object, object]]:
        sink = RequestSink()
        for i in range(5):
            sink.put_threadsafe((0, _out("a", [CompletionOutput(0, str(i), [i])], i == 4)))
            sink.put_threadsafe((1, _out("b", [CompletionOutput(0, "b", [7])])))
        error = RuntimeError("gone")
        sink.put_threadsafe((1, error))
        got = [await sink.get() for _ in range(3)]
        sink.put_threadsafe((0, _out("c", [CompletionOutput(0, "late", [8])])))
        got.append(await sink.get())
        return got

    got = asyncio.run(run())
    (tag_a, a), (tag_b, b), (tag_e, e), (_, c) = got
    assert (tag_a, a.outputs[0].text, a.outputs[0].token_ids, a.finished) == \
        (0, "01234", [0, 1, 2, 3, 4], True)
    assert (tag_b, b.outputs[0].text, b.outputs[0].token_ids) == (1, "bbbbb", [7] * 5)
    assert tag_e == 1 and isinstance(e, RuntimeError)
    assert c.outputs[0].text == "late"


def _sse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE body (chunked transfer encoding undone)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n", 1)[0], head
    data, rest = b"", body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        data, rest = data + rest[:size], rest[size + 2:]
    return [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]


@pytest.mark.parametrize("api_servers", [None, 2], ids=["default", "api-servers-2"])
def test_slow_reader_gets_merged_events_and_the_full_text(api_servers: int | None) -> None:
    """A client that stops reading (small socket buffers, nothing read until the engine has
    finished its request: the server's writes back up) then gets the rest in fewer events than
    tokens, and the same text and logprobs as a client that reads at once."""
    body = {"prompt": "once upon a time", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "logprobs": 20}
    with live_server(send_buffer=4096, api_servers=api_servers) as s:
        fast = httpx.post(s.api_url + "/completions", json=body, timeout=120).json()
        payload = json.dumps({**body, "stream": True}).encode()
        host, port = s.base_url.removeprefix("http://").split(":")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(120)
            sock.connect((host, int(port)))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: " + str(len(payload)).encode()
                         + b"\r\n\r\n" + payload)
            raw = sock.recv(1024)
            wait_drained(s.engine, timeout=120)  # the engine is done; the client read nothing
            while not raw.endswith(b"0\r\n\r\n"):
                chunk = sock.recv(65536)
                assert chunk, "the server closed the stream early"
                raw += chunk
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == fast["choices"][0]["text"]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == fast["choices"][0]["logprobs"]["tokens"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert fast["usage"]["completion_tokens"] == 200
    per_event = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks]
    assert sum(per_event) == 200 and len(chunks) < 200 and max(per_event) > 1, per_event
