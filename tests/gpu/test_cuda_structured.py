"""GPU checks of structured outputs: a grammar-heavy batch runs with no hidden host sync
(the mask H2D waits on the device for the grammar worker's fence word, on the mask stream, and is
event-fenced for sampling), and pipelined equals blocking on CUDA.

Needs xgrammar and jsonschema (`pip install -e ".[test]"` installs both)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from photon import LLM, SamplingParams
from photon.structured.params import StructuredOutputsParams as SO
from tests.gpu.test_cuda_pipeline import KW, sync_debug_error  # noqa: F401 - fixture
from tests.test_pipeline import run
from tests.test_structured_pipeline import _specs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "score": {"type": "integer", "minimum": 0, "maximum": 100},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
    "required": ["name", "score", "tags"]}


def test_grammar_pipelined_equals_blocking_cuda() -> None:
    """Blocking, pipelined with the GPU waiting for the grammar worker (default), and pipelined
    with the engine thread waiting for it: the same tokens."""
    specs = _specs()
    # The CPU test's cache: one 160-token (max_model_len) request fits.
    kw = {**KW, "num_gpu_blocks_override": 40, "max_model_len": 160}
    blocking, _ = run(LLM(pipelined=False, **kw), specs)
    llm = LLM(pipelined=True, **kw)
    assert llm.engine.runner.streams.word_wait is not None
    pipelined, _ = run(llm, specs)
    host_waits, _ = run(LLM(pipelined=True, structured_outputs_mask_wait="host", **kw), specs)
    assert pipelined == blocking
    assert host_waits == blocking


def test_engine_thread_never_waits_for_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the grammar worker on CUDA, sample enqueues the masks behind the worker's fence
    word and returns: every job is collected at the next commit, none inside sample."""
    llm = LLM(pipelined=True, **{**KW, "num_gpu_blocks_override": 40, "max_model_len": 160})
    runner, manager = llm.engine.runner, llm.engine.structured
    where = {"sample": 0, "elsewhere": 0}
    inside = {"now": False}
    real_sample, real_wait = runner.sample, manager.wait

    def sample(h: object) -> None:
        inside["now"] = True
        try:
            real_sample(h)
        finally:
            inside["now"] = False

    def wait() -> list:
        where["sample" if inside["now"] else "elsewhere"] += 1
        return real_wait()

    monkeypatch.setattr(runner, "sample", sample)
    monkeypatch.setattr(manager, "wait", wait)
    specs = _specs()
    outs, _ = run(llm, specs)
    assert where["sample"] == 0 and where["elsewhere"] > 20
    assert len(outs) == len(specs)


def test_grammar_batch_no_hidden_sync(sync_debug_error: list[int]) -> None:  # noqa: F811
    torch.cuda.set_sync_debug_mode(0)
    llm = LLM(device="cuda", dtype="bfloat16", max_num_seqs=32, max_num_batched_tokens=256,
              block_size=16, max_model_len=512)
    core = llm.engine
    kinds = [SO(json=SCHEMA), SO(regex=r"[a-z]{2,6}-[0-9]{1,3}"), SO(choice=["yes", "no"]), None]
    ids = []
    for i in range(32):
        spec = kinds[i % len(kinds)]
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=spec)
        ids.append(core.add_request(f"Request {i}: give JSON", params))
    # Compile before the sync check: compile threads are not the loop under test.
    for req in list(core.scheduler.grammar_waiting):
        req.grammar.future.result()
    torch.cuda.set_sync_debug_mode("error")
    outs = {}
    while core.has_unfinished():
        outs.update({o.request_id: o for o in core.step() if o.finished})
    torch.cuda.set_sync_debug_mode(0)
    assert sync_debug_error[0] > 10
    for i, rid in enumerate(ids):
        out = outs[rid].outputs[0]
        if i % len(kinds) == 0:
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(out.text), SCHEMA)
    core.assert_drained()


def test_late_worker_stalls_the_gpu_not_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grammar worker is stopped (SIGSTOP) just before a mid-run job is submitted and resumed
    0.3 s later: after sample that step's mask copy is still waiting on the device (the GPU
    waits on the fence word, the engine thread went on), and every output equals the blocking
    loop's."""
    import signal
    import threading

    specs = _specs()
    kw = {**KW, "num_gpu_blocks_override": 40, "max_model_len": 160}
    blocking, _ = run(LLM(pipelined=False, **kw), specs)
    llm = LLM(pipelined=True, **kw)
    runner, grammar = llm.engine.runner, llm.engine.grammar
    real_begin, real_sample = grammar.begin, runner.sample
    state: dict = {"calls": 0, "stopped": None, "waiting": None}

    def begin(committed: object, sampled: object, upcoming: int | None) -> frozenset[int]:
        state["calls"] += 1
        if state["stopped"] is None and state["calls"] >= 10 and upcoming is not None \
                and upcoming in grammar._planned:
            proc = llm.engine.structured.executor.proc
            proc.send_signal(signal.SIGSTOP)
            threading.Timer(0.3, proc.send_signal, (signal.SIGCONT,)).start()
            state["stopped"] = upcoming
        return real_begin(committed, sampled, upcoming)

    def sample(h: object) -> None:
        real_sample(h)
        if h.step == state["stopped"]:
            state["waiting"] = not h.slot.mask_ready.query()

    monkeypatch.setattr(grammar, "begin", begin)
    monkeypatch.setattr(runner, "sample", sample)
    pipelined, _ = run(llm, specs)
    assert state["stopped"] is not None and state["waiting"] is True
    assert pipelined == blocking


def test_stream_waits_for_host_word_on_device() -> None:
    """cuStreamWaitValue32 on a word of registered shared memory: a copy queued behind it runs
    only once the host writes a value at or past the awaited one."""
    import mmap
    import time

    import numpy as np

    from photon.structured.worker import _cuda_register
    from photon.worker.stream_wait import HostWordWait

    mem = mmap.mmap(-1, 4096)
    words = np.frombuffer(mem, dtype=np.uint32)
    assert _cuda_register(words, 4096)
    try:
        wait = HostWordWait.create(torch.device("cuda"))
        assert wait is not None
        stream = torch.cuda.Stream()
        src = torch.arange(1024, device="cuda", dtype=torch.int32)
        dst = torch.zeros_like(src)
        done = torch.cuda.Event()
        wait.enqueue(stream, words.ctypes.data + 4, 5)
        with torch.cuda.stream(stream):
            dst.copy_(src)
            done.record()
        time.sleep(0.2)
        assert not done.query()
        words[1] = 4
        time.sleep(0.2)
        assert not done.query()
        words[1] = 7
        done.synchronize()
        assert torch.equal(dst, src)
    finally:
        words[1] = 1000  # never leave the GPU waiting
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(words.ctypes.data)
