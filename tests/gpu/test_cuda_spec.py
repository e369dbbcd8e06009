"""GPU checks of speculative decoding (n-gram proposer): on CUDA, greedy with speculation gives
exactly the tokens of greedy without it (float32), with CUDA graphs serving the speculative
steps and eagerly alike, pipelined equals blocking, the Triton verification runs, and the
speculative loop makes no host sync but the commit's wait."""

from __future__ import annotations

import pytest
import torch

from photon import LLM, SamplingParams
from photon.engine.engine_core import EngineCore
from tests.gpu.test_cuda_pipeline import sync_debug_error  # noqa: F401 - the fixture
from tests.test_pipeline import Spec, run
from tests.test_spec_engine import GREEDY, _prompts
from tests.test_spec_graphs import _Cycle

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KW = dict(model="photon-tiny-random", device="cuda", dtype="float32", max_model_len=256)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4, "adaptive": False}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_equals_greedy_cuda(k: int) -> None:
    specs = [Spec(p, GREEDY) for p in _prompts(k)]
    base, _ = run(LLM(pipelined=False, **KW), specs)
    spec = {**NGRAM, "num_speculative_tokens": k}
    pipelined_llm = LLM(pipelined=True, speculative_config=spec, **KW)
    pipelined, audit_p = run(pipelined_llm, specs)
    blocking_llm = LLM(pipelined=False, speculative_config=spec, **KW)
    blocking, audit_b = run(blocking_llm, specs)
    eager, _ = run(LLM(pipelined=True, enforce_eager=True, speculative_config=spec, **KW), specs)
    assert pipelined == base
    assert blocking == base
    assert eager == base
    assert audit_p.schedule == audit_b.schedule
    assert pipelined_llm.engine.runner.spec.counters.num_accepted_tokens > 0
    for llm in (pipelined_llm, blocking_llm):  # the speculative steps replayed their graphs
        assert llm.engine.runner.graphs.spec_replays > 0


def test_every_k_eff_replays_a_graph_cuda() -> None:
    """Adaptive K_eff (a policy cycling 0, 3, 1, 2, 3): 1..K replay speculative graphs, 0 the
    decode graphs; greedy tokens stay those of greedy decoding."""
    specs = [Spec(p, GREEDY) for p in _prompts(7)]
    base, _ = run(LLM(pipelined=False, **KW), specs)
    llm = LLM(speculative_config={**NGRAM, "adaptive": True}, max_num_seqs=4, **KW)
    llm.engine.scheduler.spec_policy = _Cycle()
    out, _ = run(llm, specs)
    graphs = llm.engine.runner.graphs
    assert out == base
    assert graphs.spec_replays > 0 and graphs.decode.replays > 0
    assert {key.k for key in graphs.spec.graphs} == {1, 2, 3}


def test_no_hidden_sync_with_speculation(sync_debug_error: list[int]) -> None:  # noqa: F811
    torch.cuda.set_sync_debug_mode(0)
    llm = LLM(speculative_config=NGRAM, **{**KW, "dtype": "bfloat16"})
    core = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=3, max_tokens=40,
                             ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, seed=4, max_tokens=40, presence_penalty=0.5,
                             repetition_penalty=1.2, ignore_eos=True)] * 3
    prompts = ["def f(x):\n    return x + 1\n" * (i + 2) for i in range(len(params))]
    run_speculative_without_sync(core, prompts, params, sync_debug_error)


def run_speculative_without_sync(core: EngineCore, prompts: list[str],
                                 params: list[SamplingParams], waits: list[int]) -> None:
    """Run the requests with any host sync but the commit's wait raising; then the drafts were
    accepted, speculative graphs replayed, and the engine drained."""
    for prompt, sp in zip(prompts, params):
        core.add_request(prompt, sp)
    torch.cuda.set_sync_debug_mode("error")
    while core.has_unfinished():
        core.step()
    torch.cuda.set_sync_debug_mode(0)
    assert waits[0] > 0
    assert core.runner.spec.counters.num_accepted_tokens > 0
    assert core.runner.graphs.spec_replays > 0  # graphs on: the replays made no sync either
    core.assert_drained()


@pytest.mark.parametrize(("rows", "max_seqs"), [(1, 1), (4, 4), (3, 4), (5, 8)])
def test_greedy_steps_sample_in_their_graph_cuda(rows: int, max_seqs: int) -> None:
    """Greedy speculative steps sample through the sampling graph
    (photon.worker.spec_sample_graphs), padding rows on the scratch row when the step's rows
    do not fill the graph: the tokens, drafts and acceptances of the eager sampling (the same
    engine with the sampling graphs removed)."""
    specs = [Spec(p, GREEDY) for p in (_prompts(3) * 3)[:rows]]
    base, _ = run(LLM(pipelined=False, **KW), specs)
    spec = {**NGRAM, "num_speculative_tokens": 5}
    graphed = LLM(pipelined=True, speculative_config=spec, max_num_seqs=max_seqs, **KW)
    out_g, _ = run(graphed, specs)
    eager = LLM(pipelined=True, speculative_config=spec, max_num_seqs=max_seqs, **KW)
    eager.engine.runner.sampling.graphs = None
    out_e, _ = run(eager, specs)
    assert out_g == out_e == base
    assert graphed.engine.runner.sampling.graphs.replays > 0
    c_g, c_e = (llm.engine.runner.spec.counters for llm in (graphed, eager))
    assert (c_g.num_drafts, c_g.num_accepted_tokens) == (c_e.num_drafts, c_e.num_accepted_tokens)
    assert c_g.num_accepted_tokens > 0


def test_no_hidden_sync_in_sampling_graphs(sync_debug_error: list[int]) -> None:  # noqa: F811
    torch.cuda.set_sync_debug_mode(0)
    llm = LLM(speculative_config={**NGRAM, "num_speculative_tokens": 5}, max_num_seqs=2,
              **{**KW, "dtype": "bfloat16"})
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 2
    prompts = ["def f(x):\n    return x + 1\n" * (i + 2) for i in range(2)]
    run_speculative_without_sync(llm.engine, prompts, params, sync_debug_error)
    assert llm.engine.runner.sampling.graphs.replays > 0
