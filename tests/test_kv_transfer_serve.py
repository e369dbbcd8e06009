"""Prefill/decode disaggregation end to end: a producer and a consumer `photon serve` app (the
engine core in its own process) with the SharedMemoryConnector behind `photon proxy`, through the
openai client: the text equals one server's, streamed and not, and both sides drain."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from photon.proxy.app import build_proxy_app
from photon.proxy.config import ProxyConfig
from tests.server_util import LiveServer, live_server, openai_client, serve_asgi, wait_drained

pytestmark = pytest.mark.timeout(300)

ENGINE = {"model": "photon-tiny", "dtype": "float32", "block_size": 4, "max_model_len": 256}


def _kvt(role: str, rendezvous: str) -> dict:
    return {"kv_connector": "SharedMemoryConnector", "kv_role": role,
            "kv_connector_extra_config": {"rendezvous": rendezvous}}


@contextmanager
def _deployment() -> Iterator[tuple[LiveServer, LiveServer, LiveServer, str]]:
    name = "s" + uuid.uuid4().hex[:12]
    with ExitStack() as stack:
        pre = stack.enter_context(live_server(
            {**ENGINE, "kv_transfer_config": _kvt("kv_producer", name)}, api_servers=1))
        dec = stack.enter_context(live_server(
            {**ENGINE, "kv_transfer_config": _kvt("kv_consumer", name)}, api_servers=1))
        ref = stack.enter_context(live_server(ENGINE, api_servers=1))
        cfg = ProxyConfig(prefill=(pre.base_url,), decode=(dec.base_url,))
        url = stack.enter_context(serve_asgi(build_proxy_app(cfg)))
        yield pre, dec, ref, url


def test_proxy_with_shared_memory_transfer_equals_one_server() -> None:
    prompts = ["def fibonacci(n):\n", "import os\n\nclass Config:\n    def __init__(self"]
    with _deployment() as (pre, dec, ref, url):
        client = openai_client(LiveServer(None, url, None, None))
        direct = openai_client(ref)
        for prompt in prompts:
            args = {"model": "photon-tiny", "prompt": prompt, "max_tokens": 24,
                    "temperature": 0}
            want = direct.completions.create(**args).choices[0].text
            assert client.completions.create(**args).choices[0].text == want
            streamed = "".join(c.choices[0].text for c in
                               client.completions.create(**args, stream=True) if c.choices)
            assert streamed == want
            seeded = {**args, "temperature": 0.8, "seed": 11}
            assert (client.completions.create(**seeded).choices[0].text
                    == direct.completions.create(**seeded).choices[0].text)
        stats = dec.engine.stats() if hasattr(dec.engine, "stats") else None
        for live in (pre, dec):
            wait_drained(live.engine)
    if stats is not None and getattr(stats, "kv_transfer", None) is not None:
        assert stats.kv_transfer.loads_done > 0
