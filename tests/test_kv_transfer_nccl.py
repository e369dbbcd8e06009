"""Prefill/decode disaggregation with the NcclConnector on gloo (CPU, float32): a producer LLM in
a spawned process and a consumer LLM in the test's process (NCCL's code path, another backend);
the failure cases with both LLMs in one process."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from photon import LLM, SamplingParams
from photon.config import ConfigError
from photon.kv_transfer.config import parse_kv_transfer_config
from tests.test_kv_transfer import (
    ENGINE,
    MODEL,
    PREFILL,
    _abort_while_loading,
    _drain_producer,
    _ids,
    _prompts,
)

WAIT_S = 180  # bound on one answer of the producer process
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _llm(role: str | None, **extra: object) -> LLM:
    kvt = None if role is None else {"kv_connector": "NcclConnector", "kv_role": role,
                                     "kv_connector_extra_config": extra}
    return LLM(MODEL, kv_transfer_config=kvt, **ENGINE)


def _prefill(llm: LLM, prompts: list[list[int]]) -> list[dict[str, Any]]:
    outs = llm.generate(prompts, PREFILL, use_tqdm=False,
                        kv_transfer_params={"do_remote_decode": True})
    return [o.kv_transfer_params for o in outs]


# ---- the producer process ------------------------------------------------------------------
def _next_command(llm: LLM, commands: Any) -> Any:
    """The next command; meanwhile the engine steps while transfers hold blocks (it frees them
    once sent, or when their leases run out)."""
    while llm.engine.has_pending_transfers():
        llm.engine.step()
        try:
            return commands.get_nowait()
        except queue.Empty:
            continue
    return commands.get(timeout=WAIT_S)


def _producer_main(extra: dict[str, Any], commands: Any, results: Any) -> None:
    llm = _llm("kv_producer", **extra)
    try:
        while (cmd := _next_command(llm, commands)) != "exit":
            if cmd == "die":
                os._exit(0)  # killed: no cleanup, its sockets close
            results.put(("params", _prefill(llm, cmd)))
        _drain_producer(llm)
        results.put(("drained", vars(llm.engine.stats().kv_transfer)))
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put(("error", repr(e)))
    finally:
        llm.engine.shutdown()


class Producer:
    def __init__(self, commands: Any, results: Any) -> None:
        self.commands, self.results = commands, results

    def answer(self, cmd: Any, kind: str) -> Any:
        self.commands.put(cmd)
        try:
            got, value = self.results.get(timeout=WAIT_S)
        except queue.Empty:
            pytest.fail(f"the producer process did not answer {cmd!r}")
        assert got == kind, value
        return value

    def prefill(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        return self.answer(prompts, "params")


@contextmanager
def producer_process(**extra: object) -> Iterator[tuple[Producer, mp.Process]]:
    """A prefill instance in a spawned process, reaped on exit."""
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_producer_main, args=(extra, commands, results))
    proc.start()
    try:
        yield Producer(commands, results), proc
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


# ---- two processes -------------------------------------------------------------------------
def test_greedy_and_seeded_equal_one_instance() -> None:
    prompts = _prompts(8)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True)
    single = _llm(None)
    want = [_ids(single.generate(prompts, p, use_tqdm=False)) for p in (GREEDY, seeded)]
    decode = _llm("kv_consumer")
    with producer_process() as (prefill, _):
        params = prefill.prefill(prompts)
        assert all(p["remote_host"] and p["remote_port"] for p in params)
        assert _ids(decode.generate(prompts, GREEDY, use_tqdm=False,
                                    kv_transfer_params=params)) == want[0]
        stats = decode.engine.stats().kv_transfer
        assert (stats.num_received, stats.num_load_failures) == (len(prompts), 0)
        # the second time the decode side's prefix cache holds some prompts: those transfers
        # are released unread
        params = prefill.prefill(prompts)
        assert _ids(decode.generate(prompts, seeded, use_tqdm=False,
                                    kv_transfer_params=params)) == want[1]
        decode.engine.assert_drained()
        sent = prefill.answer("exit", "drained")  # the producer's drain audit passed
    received = decode.engine.stats().kv_transfer
    assert received.num_load_failures == 0
    assert (sent["num_sent"], sent["bytes_sent"]) == (received.num_received,
                                                      received.bytes_received)
    assert sent["num_expired_leases"] == 0
    decode.engine.shutdown()


def test_killed_producer_recomputes() -> None:
    first, second = _prompts(2, seed=1), _prompts(3, seed=2)
    want = _ids(_llm(None).generate(second, GREEDY, use_tqdm=False))
    decode = _llm("kv_consumer", timeout_s=120)  # the peer's death ends the wait, not this
    with producer_process() as (prefill, proc):
        decode.generate(first, GREEDY, use_tqdm=False, kv_transfer_params=prefill.prefill(first))
        params = prefill.prefill(second)
        prefill.commands.put("die")
        proc.join(WAIT_S)
        assert proc.exitcode == 0
    outs = decode.generate(second, GREEDY, use_tqdm=False, kv_transfer_params=params)
    assert _ids(outs) == want
    stats = decode.engine.stats().kv_transfer
    assert (stats.num_received, stats.num_load_failures) == (len(first), len(second))
    decode.engine.assert_drained()
    decode.engine.shutdown()


# ---- one process ---------------------------------------------------------------------------
def test_on_failure_fail_ends_the_request_cleanly() -> None:
    # the producer never offers its blocks: it answers that it has no such transfer
    prefill = _llm("kv_producer", inject_fault="drop", timeout_s=0.3)
    decode = _llm("kv_consumer", on_failure="fail")
    prompt = list(range(3, 20))
    with pytest.raises(ValueError, match="on_failure is 'fail'"):
        decode.generate([prompt], PREFILL, use_tqdm=False,
                        kv_transfer_params=_prefill(prefill, [prompt]))
    decode.engine.assert_drained()
    _drain_producer(prefill)
    assert decode.engine.stats().kv_transfer.num_load_failures == 1
    ok = decode.generate([[5, 6, 7, 8]], PREFILL, use_tqdm=False)  # the engine serves on
    assert len(ok[0].outputs[0].token_ids) == 1
    for llm in (prefill, decode):
        llm.engine.shutdown()


def test_abort_while_loading_frees_both_sides() -> None:
    # the producer never answers and the decode side's timeout is long: only the abort ends
    # its wait; the producer's lease frees its blocks
    prefill = _llm("kv_producer", inject_fault="delay", timeout_s=0.3)
    decode = _llm("kv_consumer", timeout_s=600)
    prompt = list(range(3, 30))
    _abort_while_loading(decode, prompt, _prefill(prefill, [prompt])[0])
    _drain_producer(prefill)
    assert prefill.engine.stats().kv_transfer.num_expired_leases == 1
    for llm in (prefill, decode):
        llm.engine.shutdown()


@pytest.mark.parametrize("extra, message", [
    ({"kv_port": 70000}, "kv_port must be a port number"),
    ({"kv_port": "8000"}, "kv_port must be a port number"),
    ({"kv_ip": ""}, "kv_ip must be a host name"),
])
def test_rendezvous_config_errors_name_the_field(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_kv_transfer_config({"kv_connector": "NcclConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": extra})
