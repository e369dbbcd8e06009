"""Prefill/decode disaggregation with the SharedMemoryConnector (CPU, float32): a producer LLM
and a consumer LLM in one process (a killed producer: a child process), against one instance."""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from photon import LLM, SamplingParams
from photon.config import ConfigError
from photon.errors import ParamError
from photon.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config
from photon.kv_transfer.params import KVTransferParams
from photon.kv_transfer.segment import segment_dir

ENGINE = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128)
MODEL = "photon-tiny-random"
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


@pytest.fixture
def rendezvous() -> Iterator[str]:
    """A rendezvous of the test's own; afterwards no transfer file of it may be left."""
    name = "t" + uuid.uuid4().hex[:12]
    yield name
    left = glob.glob(os.path.join(segment_dir(), f"photon-kv-{name}-*"))
    for path in left:
        os.unlink(path)
    assert left == [], "transfer files leaked"


def _llm(role: str | None, rendezvous: str = "", pipelined: bool = True, **extra: object) -> LLM:
    kvt = None if role is None else {
        "kv_connector": "SharedMemoryConnector", "kv_role": role,
        "kv_connector_extra_config": {"rendezvous": rendezvous, **extra}}
    return LLM(MODEL, pipelined=pipelined, kv_transfer_config=kvt, **ENGINE)


def _ids(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _drain_producer(llm: LLM) -> None:
    """Step until its sends are taken or their leases ran out (bounded), then audit."""
    for _ in range(5000):
        if not llm.engine.has_pending_transfers():
            break
        llm.engine.step()
    llm.engine.assert_drained()


def _abort_while_loading(llm: LLM, prompt: list[int], params: dict) -> None:
    """Add a request that loads remote KV, abort it once its load started, step until it
    ended (bounded); every block is free."""
    core = llm.engine
    rid = core.add_request(prompt, SamplingParams(max_tokens=4), stream=False,
                           kv_transfer_params=params)
    core.step()
    assert len(core.scheduler.remote.loading) == 1 and core.kv.num_used_blocks > 0
    core.abort(rid)
    for _ in range(5000):
        core.step()
        if not core.has_unfinished() and not core.has_pending_transfers():
            break
    core.assert_drained()


def _count_planned_tokens(llm: LLM) -> list[int]:
    """Tokens the engine computes, counted at each plan the runner prepares."""
    counted = [0]
    prepare = llm.engine.runner.prepare

    def counting(plan):  # noqa: ANN001, ANN202
        counted[0] += plan.num_tokens
        return prepare(plan)

    llm.engine.runner.prepare = counting
    return counted


def _transfer(prefill: LLM, decode: LLM, prompts: list[list[int]],
              params: SamplingParams) -> list:
    pre = prefill.generate(prompts, PREFILL, use_tqdm=False,
                           kv_transfer_params={"do_remote_decode": True})
    assert all(o.kv_transfer_params["do_remote_prefill"] for o in pre)
    return decode.generate(prompts, params, use_tqdm=False,
                           kv_transfer_params=[o.kv_transfer_params for o in pre])


# ---- config and params -----------------------------------------------------------------------
@pytest.mark.parametrize("value, message", [
    ({"kv_connector": "Nope", "kv_role": "kv_producer"}, "kv_connector must be one of"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "prefill"}, "kv_role must be one of"),
    ({"kv_connector": "SharedMemoryConnector"}, "kv_role is required"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both", "x": 1}, "unknown key 'x'"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"on_failure": "retry"}}, "on_failure must be one of"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"timeout_s": 0}}, "timeout_s must be a number"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"rendezvous": "../x"}}, "rendezvous must be"),
    ("{not json", "must be a JSON object"),
])
def test_config_errors_name_the_field(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match="kv_transfer_config") as e:
        parse_kv_transfer_config(value)
    assert message in str(e.value)


def test_config_defaults_and_json() -> None:
    cfg = parse_kv_transfer_config('{"kv_connector": "SharedMemoryConnector", '
                                   '"kv_role": "kv_consumer"}')
    assert isinstance(cfg, KVTransferConfig)
    assert (cfg.extra.timeout_s, cfg.extra.on_failure) == (30.0, "recompute")
    assert cfg.is_consumer and not cfg.is_producer


@pytest.mark.parametrize("value, key", [
    ({"do_remote_decode": "yes"}, "do_remote_decode"),
    ({"do_remote_prefill": True, "remote_request_id": "1"}, "remote_engine_id"),
    ({"do_remote_prefill": True, "remote_engine_id": "../../etc", "remote_request_id": "1"},
     "remote_engine_id"),
    ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
    ({"remote_port": 70000}, "remote_port"),
    ({"remote_ports": [5555, True]}, "remote_ports"),
    ({"remote_ports": 5555}, "remote_ports"),
    ({"bogus": 1}, "bogus"),
])
def test_params_errors_name_the_key(value: dict, key: str) -> None:
    with pytest.raises(ParamError) as e:
        KVTransferParams.from_dict(value)
    assert e.value.param == f"kv_transfer_params.{key}"


def test_params_need_a_connector() -> None:
    llm = _llm(None)
    with pytest.raises(ParamError, match="--kv-transfer-config"):
        llm.generate([[5, 6, 7]], PREFILL, use_tqdm=False,
                     kv_transfer_params={"do_remote_decode": True})
    llm.engine.assert_drained()


# ---- the P -> D path -------------------------------------------------------------------------
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_greedy_and_seeded_equal_one_instance(rendezvous: str, pipelined: bool) -> None:
    prompts = _prompts(12)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    single = _llm(None, pipelined=pipelined)
    want = [_ids(single.generate(prompts, p, use_tqdm=False)) for p in (greedy, seeded)]
    prefill = _llm("kv_producer", rendezvous, pipelined)
    decode = _llm("kv_consumer", rendezvous, pipelined)
    computed = _count_planned_tokens(decode)
    assert _ids(_transfer(prefill, decode, prompts, greedy)) == want[0]
    # the decode side computed each prompt's last token and its outputs (zombie rows at most
    # one more), not the prompts
    assert computed[0] <= len(prompts) * (8 + 1) < sum(map(len, prompts))
    stats = decode.engine.stats().kv_transfer
    assert (stats.num_received, stats.num_load_failures) == (len(prompts), 0)
    # the second time the decode side's prefix cache holds some prompts: fewer loads
    assert _ids(_transfer(prefill, decode, prompts, seeded)) == want[1]
    assert decode.engine.stats().kv_transfer.num_load_failures == 0
    decode.engine.assert_drained()
    _drain_producer(prefill)
    assert prefill.engine.stats().kv_transfer.num_expired_leases == 0
    for llm in (prefill, decode):
        llm.engine.shutdown()


def test_decode_prefix_hit_skips_loading(rendezvous: str) -> None:
    prefill = _llm("kv_producer", rendezvous)
    decode = _llm("kv_consumer", rendezvous)
    shared = list(range(10, 30))  # 5 blocks of 4
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    _transfer(prefill, decode, [shared + [40, 41]], greedy)
    first = decode.engine.stats().kv_transfer.bytes_received
    _transfer(prefill, decode, [shared + [50, 51, 52, 53]], greedy)
    second = decode.engine.stats().kv_transfer.bytes_received - first
    # first: 21 tokens to load = 6 blocks; second: 5 blocks hit locally, 1 block (tokens 20..24)
    assert (first // 6) == second
    decode.engine.assert_drained()
    _drain_producer(prefill)


# ---- failures --------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["drop", "delay"])
def test_lost_transfer_recomputes(rendezvous: str, fault: str) -> None:
    prompts = _prompts(6, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = _ids(_llm(None).generate(prompts, greedy, use_tqdm=False))
    prefill = _llm("kv_producer", rendezvous, timeout_s=0.3, inject_fault=fault)
    decode = _llm("kv_consumer", rendezvous, timeout_s=0.3)
    assert _ids(_transfer(prefill, decode, prompts, greedy)) == want
    assert decode.engine.stats().kv_transfer.num_load_failures == \
        sum(len(p) >= 2 for p in prompts)
    decode.engine.assert_drained()
    _drain_producer(prefill)
    if fault == "delay":  # nobody took them: the leases freed the blocks
        assert prefill.engine.stats().kv_transfer.num_expired_leases == len(prompts)


def test_on_failure_fail_ends_the_request_cleanly(rendezvous: str) -> None:
    prefill = _llm("kv_producer", rendezvous, inject_fault="drop")
    decode = _llm("kv_consumer", rendezvous, timeout_s=0.3, on_failure="fail")
    with pytest.raises(ValueError, match="on_failure is 'fail'"):
        _transfer(prefill, decode, [list(range(3, 20))], PREFILL)
    decode.engine.assert_drained()
    _drain_producer(prefill)
    ok = decode.generate([[5, 6, 7, 8]], PREFILL, use_tqdm=False)  # the engine serves on
    assert len(ok[0].outputs[0].token_ids) == 1


def test_abort_while_loading_frees_both_sides(rendezvous: str) -> None:
    # the transfer is never published and the decode side's timeout is long: only the abort
    # ends its wait; the producer's lease frees its blocks
    prefill = _llm("kv_producer", rendezvous, inject_fault="delay", timeout_s=0.3)
    decode = _llm("kv_consumer", rendezvous, timeout_s=600)
    pre = prefill.generate([list(range(3, 30))], PREFILL, use_tqdm=False,
                           kv_transfer_params={"do_remote_decode": True})
    _abort_while_loading(decode, list(range(3, 30)), pre[0].kv_transfer_params)
    _drain_producer(prefill)


_KILLED_PRODUCER = """
import json, os, sys
from photon import LLM, SamplingParams
llm = LLM("photon-tiny-random", block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
          max_model_len=128, kv_transfer_config={"kv_connector": "SharedMemoryConnector",
          "kv_role": "kv_producer", "kv_connector_extra_config": {"rendezvous": sys.argv[1],
          "inject_fault": "delay"}})
out = llm.generate([json.loads(sys.argv[2])], SamplingParams(temperature=0, max_tokens=1),
                   use_tqdm=False, kv_transfer_params={"do_remote_decode": True})
print(json.dumps(out[0].kv_transfer_params), flush=True)
os._exit(0)  # killed: no cleanup, its transfer never published
"""


def test_dead_producer_never_hangs_the_request(rendezvous: str) -> None:
    prompt = list(range(3, 30))
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = _ids(_llm(None).generate([prompt], greedy, use_tqdm=False))
    proc = subprocess.run([sys.executable, "-c", _KILLED_PRODUCER, rendezvous, json.dumps(prompt)],
                          capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    params = json.loads(proc.stdout.strip().splitlines()[-1])
    decode = _llm("kv_consumer", rendezvous, timeout_s=600)  # the peer's death ends the wait
    outs = decode.generate([prompt], greedy, use_tqdm=False, kv_transfer_params=params)
    assert _ids(outs) == want
    assert decode.engine.stats().kv_transfer.num_load_failures == 1
    decode.engine.assert_drained()
    for path in glob.glob(os.path.join(segment_dir(), f"photon-kv-{rendezvous}-*.tmp")):
        os.unlink(path)  # the dead producer's unpublished file

