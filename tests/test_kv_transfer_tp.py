"""Prefill/decode disaggregation with tensor parallelism (SharedMemoryConnector, CPU, gloo): a
tp=2 producer and a tp=2 consumer, each rank moving its own KV shard, against one tp=1
instance; a load that fails on one rank only recomputes the whole request. One pair of engines
serves every case (each tensor-parallel engine starts a worker process)."""

from __future__ import annotations

import os

import pytest
import torch

from photon import LLM, SamplingParams
from photon.config import ConfigError
from photon.distributed.kv_reports import RankedConnector
from photon.engine_args import EngineArgs
from photon.errors import ParamError
from photon.kv_transfer import segment
from photon.kv_transfer.base import KVConnectorBase, KVConnectorRole
from photon.kv_transfer.config import parse_kv_transfer_config
from photon.kv_transfer.metadata import KVConnectorMetadata, KVTransferReport, LoadSpec
from tests.test_kv_transfer import (
    ENGINE,
    MODEL,
    PREFILL,
    _drain_producer,
    _ids,
    _prompts,
    _transfer,
    rendezvous,  # noqa: F401 - the fixture
)

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _llm(role: str | None, name: str = "", tp: int = 2, **extra: object) -> LLM:
    kvt = None if role is None else {
        "kv_connector": "SharedMemoryConnector", "kv_role": role,
        "kv_connector_extra_config": {"rendezvous": name, **extra}}
    return LLM(MODEL, tensor_parallel_size=tp, kv_transfer_config=kvt, **ENGINE)


def _shutdown(*llms: LLM) -> None:
    """Stop the engines; every tensor-parallel worker exited cleanly (reaped)."""
    for llm in llms:
        procs = list(llm.engine.workers.procs) if llm.engine.workers is not None else []
        llm.engine.shutdown()
        assert [p.exitcode for p in procs] == [0] * len(procs)


def _half_a_transfer(decode: LLM, name: str, prompt: list[int], good_rank: int) -> dict:
    """A transfer whose shard of `good_rank` is valid and whose other shard is not (its
    header does not match): the kv_transfer_params that name it."""
    cache = decode.engine.runner.kv_caches[0]  # [2, blocks, bs, heads, dim]: rank 0's shard
    num_blocks = -(-len(prompt) // ENGINE["block_size"])
    layers = [torch.randn(num_blocks, *cache.shape[:1], *cache.shape[2:])
              for _ in decode.engine.runner.kv_caches]
    engine_id, transfer_id = f"{os.getpid()}-fake", f"half{good_rank}"
    for rank in (0, 1):
        path = segment.segment_path(segment.segment_dir(), name, engine_id, transfer_id,
                                    rank)
        if rank == good_rank:
            segment.write_segment(path, layers)
        else:
            with open(path, "w") as f:
                f.write("{}\n")
    return {"do_remote_prefill": True, "remote_engine_id": engine_id,
            "remote_request_id": transfer_id, "tp_size": 2}


def test_tp2_pair_equals_one_instance(rendezvous: str) -> None:  # noqa: F811
    """Both ranks load their shard (2 KV heads: one per rank) and the greedy outputs equal one
    tp=1 instance's; a load that failed on either rank alone recomputes the request; a
    producer of another tensor-parallel size is refused at the edge."""
    prompts = _prompts(6, seed=5)
    want = _ids(_llm(None, tp=1).generate(prompts, GREEDY, use_tqdm=False))
    prefill = _llm("kv_producer", rendezvous)
    decode = _llm("kv_consumer", rendezvous)
    try:
        assert _ids(_transfer(prefill, decode, prompts, GREEDY)) == want
        stats = decode.engine.stats().kv_transfer
        assert (stats.num_received, stats.num_load_failures) == (len(prompts), 0)
        # the heads split evenly: rank 0 loaded half the bytes
        assert decode.engine.runner.kv_connector.local.stats().bytes_received * 2 == \
            stats.bytes_received > 0
        for good_rank in (0, 1):
            params = _half_a_transfer(decode, rendezvous, prompts[0], good_rank)
            outs = decode.generate([prompts[0]], GREEDY, use_tqdm=False,
                                   kv_transfer_params=params)
            assert _ids(outs) == want[:1]
        stats = decode.engine.stats().kv_transfer
        assert (stats.num_received, stats.num_load_failures) == (len(prompts), 2)
        tp1 = {"do_remote_prefill": True, "remote_engine_id": "1-a", "remote_request_id": "1",
               "tp_size": 1}
        with pytest.raises(ParamError, match="tensor_parallel_size 1, this instance 2") as e:
            decode.generate([[5, 6, 7]], GREEDY, use_tqdm=False, kv_transfer_params=tp1)
        assert e.value.param == "kv_transfer_params.tp_size"
        decode.engine.assert_drained()
        _drain_producer(prefill)
    finally:
        _shutdown(prefill, decode)


def _nccl(role: str) -> LLM:
    return LLM(MODEL, tensor_parallel_size=2, kv_transfer_config={
        "kv_connector": "NcclConnector", "kv_role": role}, **ENGINE)


def test_nccl_tp2_pair_equals_one_instance() -> None:
    """NcclConnector (gloo): rank r of the decode instance pairs with rank r of the prefill
    instance (each its own rendezvous, its port in remote_ports) and the greedy outputs equal
    one tp=1 instance's; a rank that reaches the other rank's rendezvous is refused and the
    whole request recomputes; both drain with every block free."""
    prompts = _prompts(4, seed=6)
    want = _ids(_llm(None, tp=1).generate(prompts, GREEDY, use_tqdm=False))
    prefill, decode = _nccl("kv_producer"), _nccl("kv_consumer")
    try:
        outs = _transfer(prefill, decode, prompts, GREEDY)
        assert _ids(outs) == want
        stats = decode.engine.stats().kv_transfer
        assert (stats.num_received, stats.num_load_failures) == (len(prompts), 0)
        assert decode.engine.runner.kv_connector.local.stats().bytes_received * 2 == \
            stats.bytes_received > 0
        params = prefill.generate(prompts[:1], PREFILL, use_tqdm=False,
                                  kv_transfer_params={"do_remote_decode": True})
        params = params[0].kv_transfer_params
        ports = params["remote_ports"]
        assert len(set(ports)) == 2 and ports[0] == params["remote_port"]
        # each rank's shard goes once: rank 1 asking rank 0 fails, then rank 0 asking rank 1
        for port in ports:
            outs = decode.generate(prompts[:1], GREEDY, use_tqdm=False,
                                   kv_transfer_params={**params, "remote_ports": [port] * 2})
            assert _ids(outs) == want[:1]
        stats = decode.engine.stats().kv_transfer
        assert (stats.num_received, stats.num_load_failures) == (len(prompts), 2)
        with pytest.raises(ParamError, match="remote_ports must name") as e:
            decode.generate(prompts[:1], GREEDY, use_tqdm=False,
                            kv_transfer_params={**params, "remote_ports": ports[:1]})
        assert e.value.param == "kv_transfer_params.remote_ports"
        decode.engine.assert_drained()
        _drain_producer(prefill)
        assert prefill.engine.stats().kv_transfer.num_expired_leases == 0
    finally:
        _shutdown(prefill, decode)


def test_kv_port_leaves_a_port_per_rank() -> None:
    kvt = {"kv_connector": "NcclConnector", "kv_role": "kv_producer",
           "kv_connector_extra_config": {"kv_port": 65535}}
    with pytest.raises(ConfigError, match="kv_port 65535 leaves no port"):
        EngineArgs(model=MODEL, tensor_parallel_size=2, kv_transfer_config=kvt).create_config()


class _Local(KVConnectorBase):
    """A rank's worker side whose finished transfers the test sets."""

    def __init__(self) -> None:
        config = parse_kv_transfer_config({"kv_connector": "SharedMemoryConnector",
                                           "kv_role": "kv_both"})
        super().__init__(config, KVConnectorRole.WORKER, "1-a", 4, 0, 2)
        self.report = KVTransferReport()

    def get_finished(self) -> tuple[set[int], set[int]]:
        report, self.report = self.report, KVTransferReport()
        self.errors = set(report.error_blocks)
        return set(report.sending), set(report.recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.errors


def test_ranked_connector_waits_for_every_rank() -> None:
    """A transfer is finished once both ranks reported it; the worker is asked only while one
    that rank 0 finished waits for it; a load failed on rank 1 alone fails the request."""
    local, worker, asked = _Local(), [KVTransferReport()], [0]

    def poll() -> list[KVTransferReport]:
        asked[0] += 1
        report, worker[0] = worker[0], KVTransferReport()
        return [report]

    ranked = RankedConnector(local, poll)
    ranked.bind_connector_metadata(KVConnectorMetadata(loads=[
        LoadSpec(7, "2-b", "t7", 0, [3, 4]), LoadSpec(8, "2-b", "t8", 0, [5])]))
    worker[0] = KVTransferReport(sending=[1])  # rank 1 first: nobody asks it yet
    ranked.collect_reports()
    assert ranked.get_finished() == (set(), set()) and asked[0] == 0
    local.report = KVTransferReport(sending=[1], recving=[7, 8])
    assert ranked.get_finished() == (set(), set())  # rank 0 done, rank 1 not yet asked
    ranked.collect_reports()  # asked: it reports send 1; the loads still wait for it
    assert asked[0] == 1 and ranked.has_pending()
    worker[0] = KVTransferReport(recving=[8], error_blocks=[5])
    ranked.collect_reports()
    assert ranked.get_finished() == ({1}, {8})
    assert ranked.get_block_ids_with_load_errors() == {5}
    worker[0] = KVTransferReport(recving=[7])
    ranked.collect_reports()
    assert ranked.get_finished() == (set(), {7}) and not ranked.has_pending()
    assert ranked.get_block_ids_with_load_errors() == set()
    ranked.collect_reports()  # nothing waits: no collective
    assert asked[0] == 3
    stats = ranked.stats()
    assert (stats.num_received, stats.num_load_failures) == (1, 1)
