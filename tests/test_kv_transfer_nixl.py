"""Prefill/decode disaggregation with the NixlConnector (CPU, float32, NIXL over UCX): a
producer LLM and a consumer LLM in the test's process against one instance (each connector's
transfer thread polls its NIXL agent; the producer's engine steps only to free the blocks)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from photon import LLM, SamplingParams
from photon.config import ConfigError
from photon.errors import ParamError
from tests.test_kv_transfer import (
    ENGINE,
    MODEL,
    PREFILL,
    _abort_while_loading,
    _drain_producer,
    _ids,
    _prompts,
)

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _config(role: str, **extra: object) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role,
            "kv_connector_extra_config": extra}


def _llm(role: str | None, **extra: object) -> LLM:
    return LLM(MODEL, kv_transfer_config=None if role is None else _config(role, **extra),
               **ENGINE)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[LLM, LLM]]:
    pytest.importorskip("nixl")
    prefill, decode = _llm("kv_producer"), _llm("kv_consumer")
    yield prefill, decode
    for llm in (prefill, decode):
        llm.engine.shutdown()


def _prefill(llm: LLM, prompts: list[list[int]]) -> list[dict[str, Any]]:
    outs = llm.generate(prompts, PREFILL, use_tqdm=False,
                        kv_transfer_params={"do_remote_decode": True})
    return [o.kv_transfer_params for o in outs]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_greedy_equals_one_instance(pair: tuple[LLM, LLM]) -> None:
    prefill, decode = pair
    prompts = _prompts(8)
    want = _ids(_llm(None).generate(prompts, GREEDY, use_tqdm=False))
    params = _prefill(prefill, prompts)
    assert all(p["remote_port"] and p["remote_block_ids"] for p in params)
    got = _ids(decode.generate(prompts, GREEDY, use_tqdm=False, kv_transfer_params=params))
    stats = decode.engine.stats().kv_transfer
    assert (stats.num_received, stats.num_load_failures) == (len(prompts), 0)
    # again: the decode side's prefix cache holds most blocks; a transfer with nothing left
    # to load is released unread (a notification alone)
    params = _prefill(prefill, prompts)
    again = _ids(decode.generate(prompts, GREEDY, use_tqdm=False,
                                 kv_transfer_params=params))
    assert got == want and again == want
    decode.engine.assert_drained()
    _drain_producer(prefill)  # every notification came: the blocks are free
    received, sent = decode.engine.stats().kv_transfer, prefill.engine.stats().kv_transfer
    assert received.num_load_failures == 0
    assert (sent.num_sent, sent.bytes_sent) == (received.num_received, received.bytes_received)
    assert sent.num_expired_leases == 0


def test_failed_loads_recompute(pair: tuple[LLM, LLM]) -> None:
    # a block the prefill instance does not have, and a prefill instance that is gone
    prefill, decode = pair
    prompts = _prompts(2, seed=3)
    want = _ids(_llm(None).generate(prompts, GREEDY, use_tqdm=False))
    real = _prefill(prefill, prompts[:1])[0]
    bad_block = {**real, "remote_request_id": "never-offered",
                 "remote_block_ids": [10**6] * len(real["remote_block_ids"])}
    port = _free_port()
    gone = {**real, "remote_request_id": "gone", "remote_port": port, "remote_ports": [port]}
    before = decode.engine.stats().kv_transfer.num_load_failures
    outs = [decode.generate([p], GREEDY, use_tqdm=False, kv_transfer_params=params)[0]
            for p, params in zip(prompts, (bad_block, gone))]
    # the transfer the failed loads borrowed their address from loads as usual
    outs += decode.generate(prompts[:1], GREEDY, use_tqdm=False, kv_transfer_params=real)
    assert _ids(outs) == [*want, want[0]]
    assert decode.engine.stats().kv_transfer.num_load_failures == before + 2
    decode.engine.assert_drained()
    _drain_producer(prefill)


def test_on_failure_fail_ends_the_request(pair: tuple[LLM, LLM]) -> None:
    prefill, _ = pair
    decode = _llm("kv_consumer", on_failure="fail")
    prompt = list(range(3, 20))
    real = _prefill(prefill, [prompt])[0]
    with pytest.raises(ValueError, match="on_failure is 'fail'"):
        decode.generate([prompt], PREFILL, use_tqdm=False,
                        kv_transfer_params={**real, "remote_request_id": "never-offered",
                                            "remote_block_ids": [10**6] * 5})
    ok = decode.generate([prompt], PREFILL, use_tqdm=False, kv_transfer_params=real)
    assert len(ok[0].outputs[0].token_ids) == 1  # the engine serves on
    decode.engine.assert_drained()
    _drain_producer(prefill)
    decode.engine.shutdown()


def test_abort_while_loading_frees_its_blocks(pair: tuple[LLM, LLM]) -> None:
    # the "prefill instance" accepts the connection but never answers the handshake, and
    # the decode side's timeout is long: only the abort ends the load
    _, decode = pair
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        params = {"do_remote_prefill": True, "remote_engine_id": "e1", "tp_size": 1,
                  "remote_request_id": "r1", "remote_block_ids": list(range(7)),
                  "remote_host": "127.0.0.1", "remote_port": port, "remote_ports": [port]}
        _abort_while_loading(decode, list(range(3, 30)), params)


def test_params_and_config_errors(pair: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch
                                  ) -> None:
    _, decode = pair
    params = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_request_id": "r1",
              "remote_block_ids": [0], "remote_host": "10.9.8.7", "remote_port": 5000}
    with pytest.raises(ParamError, match="allowed_remote_hosts"):
        decode.generate([[4, 5, 6, 7, 8]], PREFILL, use_tqdm=False, kv_transfer_params=params)
    monkeypatch.setitem(sys.modules, "nixl", None)  # as if not installed
    with pytest.raises(ConfigError, match="pip install nixl"):
        _llm("kv_producer")


def test_tp2_pair_equals_one_instance() -> None:
    """Rank r of the decode instance reads from rank r of the prefill instance (its own
    handshake port in remote_ports); a rank sent to the other rank's port is refused and the
    whole request recomputes; both drain with every block free, every worker reaped."""
    pytest.importorskip("nixl")
    from tests.test_kv_transfer_tp import _shutdown

    prompts = _prompts(4, seed=6)
    want = _ids(_llm(None).generate(prompts, GREEDY, use_tqdm=False))
    prefill, decode = (LLM(MODEL, tensor_parallel_size=2, kv_transfer_config=_config(role),
                           **ENGINE) for role in ("kv_producer", "kv_consumer"))
    try:
        params = _prefill(prefill, prompts)
        assert len(set(params[0]["remote_ports"])) == 2
        assert _ids(decode.generate(prompts, GREEDY, use_tqdm=False,
                                    kv_transfer_params=params)) == want
        stats = decode.engine.stats().kv_transfer
        assert (stats.num_received, stats.num_load_failures) == (len(prompts), 0)
        assert decode.engine.runner.kv_connector.local.stats().bytes_received * 2 == \
            stats.bytes_received > 0
        params = _prefill(prefill, prompts[:1])[0]
        crossed = {**params, "remote_ports": params["remote_ports"][::-1]}
        for p in (crossed, params):  # the second releases the transfer (or reads its tail)
            assert _ids(decode.generate(prompts[:1], GREEDY, use_tqdm=False,
                                        kv_transfer_params=p)) == want[:1]
        assert decode.engine.stats().kv_transfer.num_load_failures == 1
        decode.engine.assert_drained()
        _drain_producer(prefill)
    finally:
        _shutdown(prefill, decode)
