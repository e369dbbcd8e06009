"""GPU checks of the pipeline contract: pipelined == blocking on CUDA in bfloat16 with CUDA
graphs, and no hidden host sync anywhere in the loop except the designated commit wait."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from photon import LLM, SamplingParams
from photon.worker.slots import StepSlot
from tests.test_pipeline import _mixed_specs, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KW = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=6, num_gpu_blocks_override=32,
          device="cuda", dtype="bfloat16", max_model_len=128)


def test_pipelined_equals_blocking_cuda_bf16_graphs() -> None:
    specs = _mixed_specs()
    probe, _ = run(LLM(pipelined=False, **KW), specs[8:9])
    eos = frozenset({probe["r0"][0][0][5]})
    blocking, _ = run(LLM(pipelined=False, **KW), specs, eos)
    engine = LLM(pipelined=True, **KW)
    pipelined, audit = run(engine, specs, eos)
    assert pipelined == blocking
    assert engine.engine.runner.graphs is not None and engine.engine.runner.graphs.replays > 0
    assert audit.zombie_rows > 0


@pytest.fixture
def sync_debug_error(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Raise on any synchronizing CUDA call, except inside StepSlot.wait (commit's wait)."""
    waits = [0]
    orig_wait = StepSlot.wait

    def designated_wait(self: StepSlot) -> None:
        torch.cuda.set_sync_debug_mode(0)
        try:
            orig_wait(self)
            waits[0] += 1
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(StepSlot, "wait", designated_wait)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield waits
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_no_hidden_sync_in_the_loop(sync_debug_error: list[int]) -> None:
    torch.cuda.set_sync_debug_mode(0)
    llm = LLM(device="cuda", dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=64,
              block_size=16, max_model_len=512)
    core = llm.engine
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, min_p=0.05, seed=3, max_tokens=40,
                       ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, max_tokens=40, presence_penalty=0.5,
                       frequency_penalty=0.5, repetition_penalty=1.2, min_tokens=5,
                       logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop=["e"], n=2),
        SamplingParams(temperature=0.7, seed=5, max_tokens=40, ignore_eos=True,
                       logit_bias={7: 5.0, 300: -100.0}, prompt_logprobs=2, logprobs=0),
    ] * 3
    prompts = [f"Request number {i}: " + "lorem ipsum " * (i + 3) for i in range(len(params))]
    for p, sp in zip(prompts, params):
        core.add_request(p, sp)
    torch.cuda.set_sync_debug_mode("error")
    steps = 0
    while core.has_unfinished():
        core.step()
        steps += 1
    torch.cuda.set_sync_debug_mode(0)
    assert steps > 40 and sync_debug_error[0] > 40
    assert core.runner.graphs is not None and core.runner.graphs.replays > 0
    core.assert_drained()
