"""GPU checks of speculative decoding with a draft model: on CUDA, greedy with the committed
trained pair gives exactly the tokens of greedy without speculation (float32), with CUDA graphs
(the draft's catch-up captured with the target's forward, its decode steps in graphs of their
own or inside the sampling graphs) and eagerly alike, pipelined equals
blocking, the draft is accepted, and the loop makes no host sync but the commit's wait."""

from __future__ import annotations

import pytest
import torch

from photon import LLM, SamplingParams
from tests.gpu.test_cuda_pipeline import sync_debug_error  # noqa: F401 - the fixture
from tests.gpu.test_cuda_spec import run_speculative_without_sync
from tests.test_spec_draft_engine import CODE, DRAFT, TARGET

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KW = dict(model=TARGET, device="cuda", dtype="float32", max_model_len=512)
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _spec(k: int) -> dict:
    return {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": k,
            "adaptive": False}


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(CODE, GREEDY, use_tqdm=False)
    llm.engine.assert_drained()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_greedy_equals_greedy_cuda(k: int) -> None:
    base = _greedy(LLM(pipelined=False, **KW))
    pipelined = LLM(pipelined=True, speculative_config=_spec(k), **KW)
    assert _greedy(pipelined) == base
    runner = pipelined.engine.runner  # the prompts' steps: the target's and the draft's pieces
    assert runner.draft.piecewise.replays == runner.piecewise.replays > 0
    blocking = LLM(pipelined=False, speculative_config=_spec(k), **KW)
    assert _greedy(blocking) == base
    eager = LLM(pipelined=True, enforce_eager=True, speculative_config=_spec(k), **KW)
    assert _greedy(eager) == base
    assert pipelined.engine.runner.spec.counters.num_accepted_tokens > 0
    for llm in (pipelined, blocking):  # the speculative and the draft steps replayed graphs
        assert llm.engine.runner.graphs.spec_replays > 0
        # prompt steps propose with the draft graphs; the speculative steps' 3 rows (in the
        # graphs of 4: one padding row) inside their sampling graphs
        assert llm.engine.runner.draft.graphs.replays > 0
        assert llm.engine.runner.sampling.graphs.replays > 0
    assert eager.engine.runner.draft.graphs is None


def test_no_hidden_sync_with_a_draft_model(sync_debug_error: list[int]) -> None:  # noqa: F811
    torch.cuda.set_sync_debug_mode(0)
    llm = LLM(speculative_config=_spec(3), **{**KW, "dtype": "bfloat16"})
    core = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=3, max_tokens=40,
                             ignore_eos=True, logprobs=2)] * 3
    prompts = [CODE[i % len(CODE)] * (i + 1) for i in range(len(params))]
    run_speculative_without_sync(core, prompts, params, sync_debug_error)


def test_a_flapping_switch_skips_and_fills_the_draft_cuda() -> None:
    """Speculation off skips the draft's catch-up (decode graphs without it) and the next
    proposing step fills the skipped positions first: a draft equal to the target keeps
    (nearly: GEMM shapes differ between its steps and the target's) every draft accepted."""
    from tests.test_spec_plain_rows import _flapping

    spec = {"method": "draft_model", "model": TARGET, "num_speculative_tokens": 3,
            "adaptive": False}
    base = _greedy(LLM(pipelined=False, **KW))
    llm = LLM(pipelined=True, speculative_config=spec, **KW)
    _flapping(llm, k=3)
    assert _greedy(llm) == base
    graphs = llm.engine.runner.graphs
    assert graphs.lean_replays > 0 and graphs.decode.replays > 0 and graphs.spec_replays > 0
    counters = llm.engine.runner.spec.counters
    assert counters.num_accepted_tokens >= 0.9 * counters.num_draft_tokens > 0
