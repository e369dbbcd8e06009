"""A photon server whose engine takes `kv_transfer_params` as an engine with a KV connector does:
it records what each request carried and, for a request asking {"do_remote_decode": true},
returns kv_transfer_params naming the request on its final output. The tokens are the real tiny
engine's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from photon.engine.async_engine import AsyncEngine, RequestSink
from photon.engine.engine_core import EngineCore
from photon.sampling_params import SamplingParams
from photon.server.app import build_app
from tests.server_util import LiveServer, make_configs, serve_app


class TransferRecordingEngine(AsyncEngine):
    def __init__(self, core: EngineCore) -> None:
        super().__init__(core)
        self.received: list[tuple[str, dict[str, Any] | None]] = []  # (request id, params)

    async def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                          sink: RequestSink, tag: Any = None, arrival_time: float | None = None,
                          kv_transfer_params: dict[str, Any] | None = None) -> None:
        self.received.append((request_id, kv_transfer_params))
        if kv_transfer_params is not None and kv_transfer_params.get("do_remote_decode"):
            _return_params(sink, {"do_remote_prefill": True, "remote_request_id": request_id,
                                  "remote_block_ids": [1, 2]})
        await super().add_request(prompt_ids, params, request_id, sink, tag, arrival_time)


class EngineWithoutConnector(AsyncEngine):
    """An engine whose add_request has no kv_transfer_params argument."""

    async def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                          sink: RequestSink, tag: Any = None,
                          arrival_time: float | None = None) -> None:
        await super().add_request(prompt_ids, params, request_id, sink, tag, arrival_time)


def _return_params(sink: RequestSink, params: dict[str, Any]) -> None:
    """Attach `params` to the request's finished output as the consumer takes it (after the
    sink's merging, which keeps the first output's fields)."""
    get = sink.get

    async def get_with_params() -> Any:
        tag, item = await get()
        if getattr(item, "finished", False):
            item.kv_transfer_params = params
        return tag, item

    sink.get = get_with_params  # type: ignore[method-assign]


@contextmanager
def kv_transfer_server(engine_type: type[AsyncEngine] = TransferRecordingEngine
                       ) -> Iterator[LiveServer]:
    config, server_config = make_configs()
    engine = engine_type(EngineCore(config))
    try:
        with serve_app(build_app(engine, server_config)) as live:
            yield live
    finally:
        engine.shutdown()
