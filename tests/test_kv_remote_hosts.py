"""kv_connector_extra_config.allowed_remote_hosts: a decode instance's NcclConnector connects only
to the prefill hosts it allows; a request naming another host is refused at the edge (LLM and
server: the error names the host and the setting) and, should one get past, by the connector
before any connection."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from photon import LLM
from photon.config import ConfigError
from photon.engine.async_engine import AsyncEngine
from photon.errors import ParamError
from photon.kv_transfer import nccl
from photon.kv_transfer.base import KVConnectorRole, create_connector
from photon.kv_transfer.config import parse_kv_transfer_config
from photon.kv_transfer.metadata import KVConnectorMetadata, LoadSpec
from photon.server.app import build_app
from photon.server.openai_serving import ServerConfig
from tests.server_util import serve_app
from tests.test_kv_transfer import ENGINE, MODEL, PREFILL

CONSUMER = {"kv_connector": "NcclConnector", "kv_role": "kv_consumer"}
FAR = {"do_remote_prefill": True, "remote_engine_id": "1-a", "remote_request_id": "7",
       "remote_host": "10.9.8.7", "remote_port": 5555}


@pytest.fixture(autouse=True)
def no_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to reach a prefill instance fails the test."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a connection was attempted: {args}")

    monkeypatch.setattr(nccl, "ConsumerLink", refuse)


def _config(**extra: object):  # noqa: ANN202 - KVTransferConfig
    return parse_kv_transfer_config({**CONSUMER, "kv_connector_extra_config": extra})


def test_defaults_and_setting() -> None:
    assert _config(kv_ip="10.0.0.5").extra.remote_hosts() == \
        ("localhost", "127.0.0.1", "::1", "10.0.0.5")
    assert _config().extra.allows_remote_host("LOCALHOST")
    assert not _config().extra.allows_remote_host("10.9.8.7")
    assert _config(allowed_remote_hosts=["Prefill-1"]).extra.allows_remote_host("prefill-1")
    assert not _config(allowed_remote_hosts=["prefill-1"]).extra.allows_remote_host("localhost")
    assert _config(allowed_remote_hosts=["*"]).extra.allows_remote_host("10.9.8.7")
    for bad in ("10.0.0.1", [], [""], [3]):
        with pytest.raises(ConfigError, match="allowed_remote_hosts must be a non-empty list"):
            _config(allowed_remote_hosts=bad)


def test_edge_refuses_a_host_not_allowed() -> None:
    """LLM.generate raises ParamError, the server answers 400, both naming the host and the
    setting (one engine: the server's runs the LLM's core)."""
    llm = LLM(MODEL, kv_transfer_config={
        **CONSUMER, "kv_connector_extra_config": {"allowed_remote_hosts": ["prefill-1"]}},
        **ENGINE)
    message = ("'10.9.8.7' is not allowed by kv_connector_extra_config.allowed_remote_hosts "
               "(prefill-1)")
    with pytest.raises(ParamError, match=re.escape(message)) as e:
        llm.generate([[5, 6, 7, 8]], PREFILL, use_tqdm=False, kv_transfer_params=FAR)
    assert e.value.param == "kv_transfer_params.remote_host"
    llm.engine.assert_drained()
    engine = AsyncEngine(llm.engine)
    server_config = ServerConfig(served_model_name=llm.config.model.served_model_name,
                                 max_model_len=llm.config.model.max_model_len)
    try:
        with serve_app(build_app(engine, server_config)) as live:
            r = httpx.post(live.api_url + "/completions", timeout=60, json={
                "prompt": "hi", "max_tokens": 1, "kv_transfer_params": FAR})
    finally:
        engine.shutdown()
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_transfer_params.remote_host"
    assert message in error["message"]


def test_connector_refuses_before_connecting() -> None:
    """A load that names a host not allowed fails (recomputed or failed per on_failure)
    without a connection attempt."""
    conn = create_connector(_config(), KVConnectorRole.WORKER, "2-b", 4)
    conn.register_kv_caches([torch.zeros(2, 4, 4, 1, 8)])
    spec = LoadSpec(1, "1-a", "7", 0, [0, 1], "10.9.8.7", 5555)
    conn.bind_connector_metadata(KVConnectorMetadata(loads=[spec]))
    conn.start_load_kv()
    conn.clear_connector_metadata()
    assert conn.get_finished() == (set(), {1})
    assert conn.get_block_ids_with_load_errors() == {0, 1}
    assert conn.stats().num_load_failures == 1
    conn.close()
